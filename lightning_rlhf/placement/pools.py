"""Where each role runs: rank pools (HybridFlow's placement), checked before any model loads.

``RLHFStrategy(placement=...)`` takes None (every role on every rank), a mapping from each role's name to its ranks,
or ``"auto"`` (the planner's, :mod:`.auto`); docs/placement.md shows each. Two pools are either the same ranks or
disjoint: a rank in two different pools would run both pools' calls one after another and stall the other ranks of
each. Each role's FSDP mesh spans its pool, and a ``DP_SPLIT`` call splits its batch by the pool's size.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "Pools",
    "check_divides",
    "check_memory",
    "check_placement_spec",
    "check_vllm_pools",
    "pool_groups",
    "resolve_placement",
]

Pools = dict[str, tuple[int, ...]]
"""Role name -> the global ranks that hold it, ascending."""


def check_placement_spec(spec: Any) -> None:
    """Fail on a placement that is malformed whatever the run (types, negative or repeated ranks, empty pools).
    Runs on: every process, in ``RLHFStrategy.__init__`` (before any process group or model exists)."""
    if spec is None or spec == "auto":
        return
    if isinstance(spec, str):
        raise ValueError(
            f"RLHFStrategy(placement={spec!r}) is not a placement. HINT: None (every role on every rank), 'auto' "
            "(the planner chooses), or a mapping from each role's name to a list of ranks, e.g. {<role>: [0, 1], "
            "<another role>: [2, 3]}."
        )
    if not isinstance(spec, Mapping) or not spec:
        raise TypeError(
            f"RLHFStrategy(placement=...) takes None, 'auto' or a non-empty mapping role -> ranks, got "
            f"`{type(spec).__name__}` ({spec!r})."
        )
    for role, ranks in spec.items():
        where = f"RLHFStrategy(placement={{{role!r}: {ranks!r}}})"
        if not isinstance(role, str):
            raise TypeError(f"{where}: role names are strings (the module's attribute names), got {role!r}.")
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence | range):
            raise TypeError(f"{where}: give the role's ranks as a list of ints, e.g. [0, 1].")
        if not ranks:
            raise ValueError(f"{where}: the pool is empty. HINT: give the role at least one rank.")
        if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in ranks):
            raise ValueError(f"{where}: ranks are non-negative ints.")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{where}: a rank is listed twice. HINT: list each rank of the pool once.")


def resolve_placement(spec: Mapping[str, Sequence[int]] | None, roles: Sequence[str], world_size: int) -> Pools:
    """Each role's pool, checked against the module's roles and the world. Runs on: every process, in the strategy's
    ``setup_environment`` (every rank computes the same answer). Raises ``ValueError`` for a role with no pool, a pool
    naming a role the module lacks, a rank beyond the world, pools that overlap without being the same ranks, and
    a malformed ``spec`` (:func:`check_placement_spec`).
    """
    if spec is None:
        return {role: tuple(range(world_size)) for role in roles}
    check_placement_spec(spec)
    unknown = sorted(set(spec) - set(roles))
    if unknown:
        raise ValueError(
            f"RLHFStrategy(placement=...) names {unknown}, which the module does not have (its roles: "
            f"{list(roles)}). HINT: use the module's role names."
        )
    missing = [role for role in roles if role not in spec]
    if missing:
        raise ValueError(
            f"RLHFStrategy(placement=...) gives no ranks to {missing} (roles: {list(roles)}). HINT: add "
            + ", ".join(f"{role!r}: [...]" for role in missing)
            + " (the ranks of the role it should be colocated with, or ranks of its own)."
        )
    pools = {role: tuple(sorted(int(r) for r in spec[role])) for role in roles}
    for role, ranks in pools.items():
        if ranks[-1] >= world_size:
            raise ValueError(
                f"RLHFStrategy(placement={{{role!r}: {list(ranks)}}}) names rank {ranks[-1]}, but the run has "
                f"{world_size} processes (ranks 0..{world_size - 1}). HINT: a pool cannot be larger than the world; "
                "raise Trainer(devices=...)/num_nodes or give the role fewer ranks."
            )
    distinct = sorted(set(pools.values()))
    for i, a in enumerate(distinct):
        for b in distinct[i + 1 :]:
            shared = sorted(set(a) & set(b))
            if shared:
                holders = {tuple(p): [r for r in roles if pools[r] == p] for p in (a, b)}
                raise ValueError(
                    f"RLHFStrategy(placement=...): the pools {list(a)} ({', '.join(holders[a])}) and {list(b)} "
                    f"({', '.join(holders[b])}) overlap at ranks {shared}. Roles share ranks only as a whole pool: "
                    "colocated roles list the same ranks, the others disjoint ones. HINT: give them the same ranks "
                    "or ranks that do not overlap."
                )
    return pools


def check_weight_sources(pools: Pools, sources: Mapping[str, str]) -> None:
    """Refuse a role that takes another role's weights over collectives (``sources``: receiver -> source) on ranks
    of the source's pool. Runs on: the launching process (before any rank starts) and every rank at set-up."""
    for name, source in sources.items():
        senders, receivers = pools[source], pools[name]
        if set(senders) & set(receivers):
            raise ValueError(
                f"RLHFStrategy(placement=...) puts {name!r} on ranks {list(receivers)}, which overlap {source!r}'s "
                f"{list(senders)}: {name!r} is the generation-only pool that {source!r} feeds over collectives, "
                f"so it needs ranks of its own. HINT: give {name!r} ranks {source!r} does not use, or leave "
                f"{name!r} out of the placement (then {source!r} generates with its colocated engine)."
            )


def check_vllm_pools(
    pools: Pools, generating: Sequence[str], world_size: int, *, tp_size: int, processes_per_node: int
) -> None:
    """Refuse a vLLM engine whose tensor-parallel groups a pool cannot form.

    A role on part of the ranks gets one engine server per rank, and the servers of a tensor-parallel group
    (``tp_size`` consecutive ranks of the pool) meet on their host: the group must divide the pool and sit on one
    node of ``processes_per_node`` ranks. Runs on: the launching process and every rank at set-up.
    """
    for name in generating:
        ranks = list(pools[name])
        if len(ranks) == world_size or tp_size == 1:
            continue
        check_divides(pools, role=name, size=tp_size, setting="VLLMConfig.tensor_parallel_size")
        for start in range(0, len(ranks), tp_size):
            group = ranks[start : start + tp_size]
            if len({r // processes_per_node for r in group}) > 1:
                raise ValueError(
                    f"VLLMConfig(tensor_parallel_size={tp_size}) groups ranks {group} of the pool of {name!r} {ranks}, "
                    f"which sit on different nodes ({processes_per_node} processes per node): the engine servers of "
                    "a tensor-parallel group meet on one host. HINT: place the pool on whole nodes, or lower "
                    "tensor_parallel_size."
                )


def pool_groups(pools: Pools) -> list[tuple[int, ...]]:
    """The distinct pools, in a fixed order (every rank builds their process groups in this order). Runs on: every
    process, at set-up."""
    return sorted(set(pools.values()))


def check_divides(pools: Pools, *, role: str, size: int, setting: str) -> None:
    """Fail when ``size`` (e.g. a rollout TP size) does not divide the pool of ``role``. Runs on: every process, at
    set-up, before any model loads."""
    n = len(pools[role])
    if n % size:
        fits = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(
            f"{setting}={size} does not divide the {n} ranks of {role!r}'s pool {list(pools[role])}. "
            f"HINT: pick one of {fits}, or give {role!r} a pool whose size {size} divides."
        )


def check_memory(pools: Pools, role_bytes: Mapping[str, float], *, budget: float, where: str) -> None:
    """Fail when the roles placed on a rank need more memory (``budget``) than it has. ``role_bytes``: each role's
    whole-model state, which FSDP spreads over the role's pool. Runs on: every process, at set-up, before any model
    loads."""
    for pool in pool_groups(pools):
        held = [role for role, ranks in pools.items() if ranks == pool]
        need = sum(role_bytes.get(role, 0.0) / len(pool) for role in held)
        if need > budget:
            raise ValueError(
                f"{where}: the pool {list(pool)} ({', '.join(held)}) needs {need / 2**30:.3g} GiB per rank for its "
                f"models' states, and a rank has {budget / 2**30:.3g} GiB. HINT: give the pool more ranks, place fewer "
                "roles on it, or hold frozen roles in bfloat16 (RLHFModule(frozen_dtype='bfloat16'))."
            )
