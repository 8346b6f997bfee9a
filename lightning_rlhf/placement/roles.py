"""A module's roles on a placement: the roles a placement adds or removes (a generation-only ``rollout`` pool), which
roles take their weights from another and which build a rollout engine, the checks made before any rank starts, and
the placement resolved at set-up (pools checked against the world and the memory, weight bridges between pools).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lightning_rlhf.controller.dispatch import sequence_parallel_roles
from lightning_rlhf.placement.pools import (
    Pools,
    check_memory,
    check_vllm_pools,
    check_weight_sources,
    pool_groups,
    resolve_placement,
)
from lightning_rlhf.roles import Role, RolloutRole

if TYPE_CHECKING:
    from lightning_rlhf.module import RLHFModule

__all__ = [
    "bridge_pools",
    "check_asynchronous",
    "check_before_launch",
    "engine_roles",
    "place_roles",
    "placed_role_names",
    "pool_meshes",
    "prepare_roles",
    "weight_sources",
]

Spec = Mapping[str, Sequence[int]] | str | None
"""``RLHFStrategy(placement=...)``: role -> ranks, ``"auto"``, or None (every role on every rank)."""


def _named(spec: Spec) -> list[str]:
    return list(spec) if isinstance(spec, Mapping) else []


def _rollout_pool_change(module: RLHFModule, placed: list[str]) -> str | None:
    """``"add"`` when a placement naming ``placed`` gives generation a pool the module has no role for yet,
    ``"remove"`` when the module has that role and the placement no longer names it, else None."""
    if "rollout" in placed and module.rollout_role is None and module.actor.needs_rollout_engine:
        return "add"
    if "rollout" not in placed and module.rollout_role is not None:
        return "remove"
    return None


def prepare_roles(module: RLHFModule, placed: list[str]) -> None:
    """Add the roles a placement asks for by name: ``rollout`` gets a generation-only :class:`RolloutRole` (the actor
    then builds no engine of its own). Runs on: every process, in the strategy's set-up."""
    change = _rollout_pool_change(module, placed)
    if change == "add":
        module.rollout = RolloutRole(module.actor.path, tokenizer=module.tokenizer, rollout=module.rollout_config)
        module.rollout.environment = module.actor.environment
        module.actor.needs_rollout_engine = False
    elif change == "remove":  # a later fit() without the pool
        delattr(module, "rollout")
        module.actor.needs_rollout_engine = True


def placed_role_names(module: RLHFModule, placed: list[str]) -> list[str]:
    """The role names :func:`prepare_roles` leaves for a placement naming ``placed``, without changing the module
    (the launcher checks a placement with them before it starts any process). Runs on: the launching process."""
    names = list(module.roles())
    change = _rollout_pool_change(module, placed)
    if change == "add":
        names.append("rollout")
    elif change == "remove":
        names.remove("rollout")
    return names


def weight_sources(roles: Mapping[str, Role], names: list[str]) -> dict[str, str]:
    """Which of the roles ``names`` (:func:`placed_role_names`) take their weights from another role over
    collectives: receiver -> source (a generation-only pool's ``weights_from``). Runs on: any process."""
    found = ((name, getattr(roles.get(name, RolloutRole), "weights_from", None)) for name in names)
    return {name: source for name, source in found if source is not None}


def engine_roles(roles: Mapping[str, Role], names: list[str]) -> list[str]:
    """Which of the roles ``names`` (:func:`placed_role_names`) build a colocated rollout engine: the
    generation-only pool when the placement has one, else the roles that need an engine (the actor; also when
    the placement drops a pool the module had, as generation then goes back to it). Runs on: any process."""
    if "rollout" in names:
        return ["rollout"]
    return [n for n in names if n in roles and (roles[n].needs_rollout_engine or (n == "actor" and "rollout" in roles))]


def check_asynchronous(module: RLHFModule, *, rollout_pool: bool, vllm_tp: int | None = None) -> None:
    """Refuse ``AlgorithmConfig.asynchronous.max_staleness >= 1`` without a rollout pool (``rollout_pool``) or with a
    ``training_step`` that does not run ``RLHFModule.rollouts``, and streamed rollouts with what they do not serve
    (partial rollouts on an engine that cannot interrupt: vLLM at ``vllm_tp`` > 1). Runs on: the launching
    process (before any rank starts) and every process at set-up, for a fit."""
    settings = module.algorithm.asynchronous
    staleness = settings.max_staleness
    if not staleness:
        return
    if settings.streams:
        check_streamed(module, vllm_tp=vllm_tp)
    if not rollout_pool:
        raise ValueError(
            f"AlgorithmConfig.asynchronous.max_staleness={staleness} generates on a rollout pool while "
            "the actor trains, but the placement gives generation no pool of its own. HINT: "
            "RLHFStrategy(placement={'actor': [0], ..., 'rollout': [1]}), or max_staleness=0."
        )
    owner = next(k for k in type(module).__mro__ if "training_step" in vars(k))
    if not vars(owner).get("ASYNC_ROLLOUTS", False):
        raise ValueError(
            f"AlgorithmConfig.asynchronous.max_staleness={staleness}: "
            f"{type(module).__name__}.training_step does not run `self.rollouts(batch, metrics)`, so it cannot "
            "overlap generation with training. "
            "HINT: max_staleness=0, GRPOModule or PPOModule, or write the step with `rollouts` and set "
            "ASYNC_ROLLOUTS = True."
        )


def check_streamed(module: RLHFModule, *, vllm_tp: int | None) -> None:
    """Refuse partial rollouts on a vLLM rollout pool at tensor parallel > 1 (``vllm_tp``: its TP group serves rounds
    of collective ``generate`` calls, which cannot be interrupted). Runs on: the launching process and every process
    at set-up."""
    if vllm_tp is not None and vllm_tp > 1 and module.algorithm.asynchronous.partial_rollouts:
        raise ValueError(
            f"AsyncConfig(partial_rollouts=True) interrupts the rollout pool's requests at each hand-off, but a vLLM "
            f"rollout pool at VLLMConfig(tensor_parallel_size={vllm_tp}) serves rounds of collective generate calls, "
            "which cannot be interrupted. HINT: tensor_parallel_size=1 (each pool rank's engine interrupts its own "
            "requests), RLHFStrategy(rollout='hf'), or AsyncConfig(stream=True, partial_rollouts=False) to stream "
            "without interrupting."
        )


def check_before_launch(
    module: Any, fitting: bool, *, spec: Spec, world_size: int, processes_per_node: int, vllm_tp: int | None
) -> None:
    """What the ranks would refuse at set-up (:func:`place_roles`), checked before any rank starts (``vllm_tp``: the
    vLLM engine's tensor-parallel size; None: no vLLM). Runs on: the launching process (rank 0, before it starts
    ranks 1..). A module other than an ``RLHFModule`` (no ``roles()``) is left alone.
    """
    if not callable(getattr(module, "roles", None)):
        return
    names = placed_role_names(module, _named(spec))
    pools: Pools = {}
    if isinstance(spec, Mapping):
        pools = resolve_placement(spec, names, world_size)
        check_weight_sources(pools, weight_sources(module.roles(), names))
        if vllm_tp is not None:
            generating = engine_roles(module.roles(), names)
            check_vllm_pools(pools, generating, world_size, tp_size=vllm_tp, processes_per_node=processes_per_node)
    if spec != "auto":  # the planner gives each role it splits a pool of a multiple of the size
        sequence_parallel_roles(getattr(module, "sequence_parallel", 1), module.roles(), pools, world_size=world_size)
    if fitting:  # a generation-only pool is a role that takes another's weights
        check_asynchronous(module, rollout_pool=bool(weight_sources(module.roles(), names)), vllm_tp=vllm_tp)


def place_roles(
    module: RLHFModule,
    spec: Spec,
    *,
    world_size: int,
    rank: int,
    device: torch.device,
    processes_per_node: int,
    vllm_tp: int | None,
    broadcast: Callable[[Any], Any],
    fitting: bool,
) -> Pools:
    """Resolve the placement (the planner's, for ``"auto"``), add the roles it names, and check it against the
    world, the vLLM engine's tensor-parallel groups, the memory and (``fitting``) the asynchronous settings, before
    any model loads: each role's ranks. A borrowed model (LoRA's reference) placed apart from its lender gets a model
    of its own. Runs on: every rank, in the strategy's ``setup_environment`` (``broadcast``: rank 0's value to every
    rank).
    """
    prepare_roles(module, _named(spec))  # e.g. a generation-only pool's role
    roles = module.roles()
    if spec == "auto":
        from lightning_rlhf.placement.auto import auto_placement

        spec = broadcast(auto_placement(module, world_size=world_size) if rank == 0 else None)
    pools = resolve_placement(spec, list(roles), world_size)  # type: ignore[arg-type]
    sequence_parallel_roles(getattr(module, "sequence_parallel", 1), roles, pools, world_size=world_size)
    for name, role in roles.items():  # a borrowed model (LoRA's reference) is only where the lender's shards are
        lender = next((key for key, other in roles.items() if other is role.borrows_model()), None)
        if lender is not None and pools[name] != pools[lender]:
            role.hold_own_model()
    if vllm_tp is not None:
        generating = [name for name, role in roles.items() if role.rollout_engine_request() is not None]
        check_vllm_pools(pools, generating, world_size, tp_size=vllm_tp, processes_per_node=processes_per_node)
    if any(len(ranks) < world_size for ranks in pools.values()):
        from lightning_rlhf.placement.auto import rank_memory_bytes, role_state_bytes

        states = {name: role_state_bytes(role) for name, role in roles.items()}
        budget = rank_memory_bytes(device, processes_per_node)
        check_memory(pools, states, budget=budget, where="RLHFStrategy(placement=...)")
    if fitting:
        check_asynchronous(module, rollout_pool=module.rollout_role is not None, vllm_tp=vllm_tp)
    return pools


def bridge_pools(roles: Mapping[str, Role], pools: Pools, *, rank: int, device: torch.device) -> None:
    """Join each role that takes another role's weights (its ``weights_from``) to that role's pool: one process
    group, the source pool's first rank and the receiving pool's ranks (:class:`WeightBridge`). Runs on: every rank,
    at set-up (``new_group`` is collective: every rank makes every group, in role order, member or not).
    """
    import torch.distributed as dist

    from lightning_rlhf.engines.rollout.bridge import WeightBridge

    sources = weight_sources(roles, list(roles))
    check_weight_sources(pools, sources)
    for name, source in sources.items():
        senders, receivers = pools[source], pools[name]
        group = dist.new_group(sorted({senders[0], *receivers}), backend="gloo" if device.type == "cpu" else None)
        bridge = WeightBridge(group=group, src=senders[0])
        if rank in receivers:
            roles[name].weight_bridge = bridge  # type: ignore[assignment]
        if rank in senders:
            roles[source].weight_bridge = bridge  # type: ignore[assignment]


def pool_meshes(pools: Pools, whole: Any, *, rank: int) -> dict[str, Any]:
    """Each role's FSDP mesh on this ``rank``, for the roles it holds: ``whole`` (the world's data-parallel mesh)
    for a pool of every rank, else a 1-D mesh over the pool's ranks. Runs on: every rank, at set-up (a new mesh is
    collective: every rank makes every pool's, in the same order)."""
    from torch.distributed.device_mesh import DeviceMesh

    meshes = {}
    for pool in pool_groups(pools):
        if len(pool) == whole.size():
            meshes[pool] = whole
        else:
            meshes[pool] = DeviceMesh(whole.device_type, torch.tensor(pool), mesh_dim_names=("data_parallel",))
    return {name: meshes[pool] for name, pool in pools.items() if rank in pool}
