"""Transfer protocols: how a role method's data is split across the workers and gathered back.

A role method declares its protocol where it is defined (``@role_method(Dispatch.DP_SPLIT)``). On the controller,
inside a step, a call goes to the ranks of the role's pool, split by the protocol, and their results come back
merged; anywhere else the method is a plain call. Calls made inside ``with concurrently():`` return
:class:`RoleFuture` objects and go out together when the block ends. docs/architecture.md ("Transfer protocols")
has the table of protocols.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast

import torch

from lightning_rlhf.batch import Batch

__all__ = [
    "BALANCE_KEY",
    "ROWS_KEY",
    "Dispatch",
    "RoleFuture",
    "balanced_partition",
    "collect",
    "columns_of",
    "concurrently",
    "current_controller",
    "current_group",
    "current_sequence_group",
    "data_parallel_group",
    "declares_sequence_parallel",
    "in_background",
    "merge_results",
    "only_written",
    "role_method",
    "sequence_group_of",
    "sequence_parallel_of",
    "sequence_parallel_roles",
    "split_args",
    "with_written",
]

BALANCE_KEY = "dp_split_by_tokens"
"""``Batch.meta`` flag set by :func:`role_method` on a ``DP_SPLIT`` call's batch when the role ``balances_ranks``:
:func:`split_args` then balances the rows over ranks by tokens instead of cutting contiguous chunks."""
COSTS_KEY = "dp_split_costs"
"""``Batch.meta`` entry set by :func:`role_method` from the role's ``split_costs(method, batch)`` (one cost per row):
:func:`split_args` then balances the rows over ranks by those costs, before any token balance."""
ROWS_KEY = "dp_split_rows"
"""``Batch.meta`` entry of each rank's part of a balanced split: the part's row indices in the caller's batch, which
:func:`merge_results` uses to put the results back in the caller's order."""


class Dispatch(enum.Enum):
    """How a role call's arguments reach the workers and how their results come back."""

    ONE_TO_ALL = "one_to_all"
    """Every rank gets the same arguments; the controller keeps rank 0's result."""
    DP_SPLIT = "dp_split"
    """The first argument (a :class:`Batch`) is split into equal parts by data-parallel rank; results are
    concatenated (batches) or averaged (dicts of metrics) in rank order."""
    RANK_ZERO = "rank_zero"
    """Only the controller's rank runs the method; the other ranks do nothing."""


class Role(Protocol):
    """What the controller needs of a role: the name its calls are addressed by (each worker resolves the name to
    its own object), and the methods :func:`role_method` declared on its class."""

    name: str


class _Controller(Protocol):
    def call(self, role: Role, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...

    def call_many(self, calls: Sequence[tuple[Role, str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]: ...

    def start_many(self, calls: Sequence[tuple[Role, str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]: ...

    def join(self, handle: Any) -> tuple[Any, float]: ...


class _Stacks(threading.local):
    """Per thread (a background role call on a worker has its own): the controllers routing role calls, the open
    ``concurrently()`` blocks and the data-parallel groups of the role calls running."""

    def __init__(self) -> None:
        self.active: list[_Controller | None] = []
        self.recorders: list[_Recorder] = []
        self.groups: list[Any] = []
        self.sequence: list[Any] = []


_STACKS = _Stacks()
F = TypeVar("F", bound=Callable[..., Any])


def current_controller() -> _Controller | None:
    """The controller that is running a training step in this process, if any: only rank 0 has one, only inside
    the strategy's training or validation step. Runs on: any process."""
    return _STACKS.active[-1] if _STACKS.active else None


@contextlib.contextmanager
def _pushed(stack: list[Any], value: Any) -> Iterator[Any]:
    """``value`` on top of ``stack`` (one of this thread's :class:`_Stacks`) inside the block."""
    stack.append(value)
    try:
        yield value
    finally:
        stack.pop()


@contextlib.contextmanager
def data_parallel_group(group: Any, sequence: Any = None) -> Iterator[None]:
    """Make ``group`` (a process group; None: all ranks) the group of the role call that runs inside, so the training
    engine's ``world()`` and all-reduces count only the ranks of the role's pool; ``sequence``: this rank's
    sequence-parallel group within it, for a method declared ``sequence_parallel=True`` (None: none). Runs on: a
    worker rank, around one role method."""
    with _pushed(_STACKS.groups, group), _pushed(_STACKS.sequence, sequence):
        yield


def current_group() -> Any:
    """The pool's group of the role call running in this process (None: all ranks). Runs on: any process."""
    return _STACKS.groups[-1] if _STACKS.groups else None


def current_sequence_group() -> Any:
    """The sequence-parallel group of the role call running in this process (None: none). Runs on: any process."""
    return _STACKS.sequence[-1] if _STACKS.sequence else None


def controller_active(controller: _Controller | None) -> contextlib.AbstractContextManager[Any]:
    """Route role-method calls through ``controller`` (rank 0, inside a step); ``None`` makes them local
    again (while a role method itself runs, its calls to other role methods are plain calls). Runs on: any rank."""
    return _pushed(_STACKS.active, controller)


class RoleFuture:
    """The result of a role call made inside :func:`concurrently`; :meth:`result` gives it once the block has ended.
    Runs on: the controller (or the single process of a run without workers)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.seconds = 0.0
        """How long the call ran on its slowest rank (set with the result)."""
        self._done = False
        self._value: Any = None
        self._join: tuple[_Controller, Any] | None = None  # a call running in the background: how to wait for it

    def set_result(self, value: Any) -> None:
        """Resolve the future (the block's end does this). Runs on: the controller."""
        self._value, self._done = value, True

    def done(self) -> bool:
        """Whether the result is here (a background call's once :meth:`result` waited for it). Runs on: controller."""
        return self._done

    def result(self) -> Any:
        """The call's merged result. Runs on: the controller, after the ``concurrently()`` block; for a call made in
        :func:`in_background`, any time after its block: the first call waits until the call has finished on every
        rank of its pool."""
        if not self._done and self._join is not None:
            controller, handle = self._join
            self._join = None
            value, self.seconds = controller.join(handle)
            self.set_result(value)
        if not self._done:
            raise RuntimeError(
                f"The result of `{self.where}` is read inside the `with concurrently():` block that made the call; "
                "the calls of a block run when it ends. HINT: read `.result()` after the block, and make calls that "
                "need it after the block too."
            )
        return self._value

    def __repr__(self) -> str:
        return f"RoleFuture({self.where}, done={self._done})"


class _Recorder:
    """The calls of one ``concurrently()`` or ``in_background()`` block, made under ``controller`` (None: run each
    at once)."""

    def __init__(self, controller: _Controller | None) -> None:
        self.controller = controller
        self.calls: list[tuple[Role, str, tuple[Any, ...], dict[str, Any]]] = []
        self.futures: list[RoleFuture] = []

    def add(self, role: Role, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> RoleFuture:
        where = f"{role.name}.{fn.__name__}"
        for value in (*args, *kwargs.values()):
            if isinstance(value, RoleFuture):
                raise RuntimeError(
                    f"`{where}` inside a `with concurrently():` block takes the result of `{value.where}` from the "
                    "same block: calls of one block run together, so none can use another's result. HINT: make the "
                    "dependent call after the block, with `.result()`."
                )
        future = RoleFuture(where)
        if self.controller is None:  # no workers: the call runs here and now
            started = time.perf_counter()
            future.set_result(fn(role, *args, **kwargs))
            future.seconds = time.perf_counter() - started
            return future
        self.calls.append((role, fn.__name__, args, kwargs))
        self.futures.append(future)
        return future


def _recording() -> contextlib.AbstractContextManager[_Recorder]:
    """Collect the role calls made inside the block (on this thread) in a :class:`_Recorder`."""
    return _pushed(_STACKS.recorders, _Recorder(current_controller()))


@contextlib.contextmanager
def concurrently() -> Iterator[None]:
    """Run the role calls made inside the block together; each returns a :class:`RoleFuture`.

    Runs on: the controller, inside a training or validation step (without workers the calls run as they are made).
    When the block ends, its calls go out in one exchange: calls to disjoint rank pools run at the same time, calls to
    one pool in the order written. A call may not take another call's future from the same block::

        with self.concurrently():
            ref = self.reference.log_prob(rollout)   # pool {2, 3}
            values = self.critic.values(rollout)     # pool {2, 3}: after ref, on the same ranks
            old = self.actor.log_prob(rollout)       # pool {0, 1}: at the same time as the two above
        rollout = rollout.update(ref.result()).update(values.result()).update(old.result())
    """
    with _recording() as recorder:
        yield
    if recorder.calls:
        assert recorder.controller is not None
        results = recorder.controller.call_many(recorder.calls)
        seconds = getattr(recorder.controller, "last_seconds", None) or [0.0] * len(results)
        for future, value, took in zip(recorder.futures, results, seconds, strict=True):
            future.set_result(value)
            future.seconds = took


@contextlib.contextmanager
def in_background() -> Iterator[None]:
    """Start the role calls made inside the block (in a thread on each rank of their pools) and go on without waiting;
    each returns a :class:`RoleFuture` whose :meth:`~RoleFuture.result` waits for it.

    Runs on: the controller, inside a training or validation step (without workers the calls run at once). A call to
    a rank still busy with a background call is refused, and every background call must be read before the step
    ends. HybridFlow's asynchronous rollouts are one such call::

        with self.in_background():
            next_rollout = self.rollout.generate(batch)   # the rollout pool samples the next batch ...
        metrics = self.actor.update(rollout)              # ... while the actor's pool trains on this one
        rollout = next_rollout.result()
    """
    with _recording() as recorder:
        yield
    if recorder.calls:
        controller = cast(_Controller, recorder.controller)
        for future, handle in zip(recorder.futures, controller.start_many(recorder.calls), strict=True):
            future._join = (controller, handle)


def collect(rollout: Batch, futures: Mapping[str, Any], metrics: dict[str, float]) -> tuple[Batch, dict[str, float]]:
    """The results of a ``concurrently()`` block: batches merged into ``rollout`` (their new columns), dicts of
    metrics merged into one, and each call's time on its slowest rank logged as ``timing_s/<name>``.

    Runs on: the controller, after the block (``RLHFModule.collect``). ``None`` entries (a call not made) are
    skipped; anything else that is not a :class:`RoleFuture` raises ``TypeError``.
    """
    merged: dict[str, float] = {}
    for name, future in futures.items():
        if future is None:
            continue
        if not isinstance(future, RoleFuture):
            raise TypeError(
                f"RLHFModule.collect: {name!r} is a `{type(future).__name__}`, not the future of a call made "
                "inside `with self.concurrently():`. HINT: make the call inside the block, or merge its result "
                "yourself."
            )
        value = future.result()
        if isinstance(value, Batch):
            rollout = rollout.update(value)
        elif isinstance(value, Mapping):
            merged |= value
        metrics[f"timing_s/{name}"] = future.seconds
    return rollout, merged


def role_method(
    dispatch: Dispatch,
    *,
    reads: Sequence[str] | None = None,
    writes: Sequence[str] | Callable[[Any], Sequence[str]] | None = None,
    sequence_parallel: bool = False,
) -> Callable[[F], F]:
    """Declare a role method's transfer protocol (``dispatch``), and for a ``DP_SPLIT`` method over a
    :class:`Batch` which of its columns travel.

    Runs on: import time (decorator). The wrapped method runs on the controller (which distributes it) or locally on
    a worker. On the controller, a ``DP_SPLIT`` call's batch is marked with :data:`BALANCE_KEY` when the role's
    ``balances_ranks`` is true (on a shallow copy). Raises ``ValueError`` for columns declared on another protocol.

    ``reads``: the columns the method reads (those the batch lacks are skipped); only they go to the workers, with
    the batch's ``meta``. ``writes``: the columns the method adds (or a function of the role that gives them): only
    they come back, set on a shallow copy of the caller's batch. The method must then return its input batch, one
    row per input row, with no other column changed or added (checked on the worker). None: every column.
    ``sequence_parallel``: the method's forwards split each sequence over the role's sequence-parallel groups
    (``role.sequence_parallel`` ranks each, consecutive in the pool): each group's ranks get the same rows, and the
    result is the first rank's of each group.
    """
    if (reads is not None or writes is not None or sequence_parallel) and dispatch is not Dispatch.DP_SPLIT:
        raise ValueError(
            f"role_method({dispatch}, reads=..., writes=...): column declarations apply to Dispatch.DP_SPLIT methods "
            "(a Batch split over ranks) only, and so does sequence_parallel=True."
        )

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(self: Role, *args: Any, **kwargs: Any) -> Any:
            controller = current_controller()
            recorder = _STACKS.recorders[-1] if _STACKS.recorders else None
            if recorder is not None and recorder.controller is not controller:
                recorder = None  # a role method running on a worker: its calls are plain calls
            if controller is None:
                return fn(self, *args, **kwargs) if recorder is None else recorder.add(self, fn, args, kwargs)
            if dispatch is Dispatch.DP_SPLIT and args and isinstance(args[0], Batch):
                split_costs = getattr(self, "split_costs", None)
                costs = split_costs(fn.__name__, args[0]) if split_costs is not None else None
                args = (_mark_balance(args[0], bool(getattr(self, "balances_ranks", False)), costs), *args[1:])
            if recorder is not None:
                return recorder.add(self, fn, args, kwargs)
            return controller.call(self, fn.__name__, args, kwargs)

        wrapper.__rlhf_dispatch__ = dispatch  # type: ignore[attr-defined]
        wrapper.__rlhf_columns__ = (None if reads is None else tuple(reads), writes)  # type: ignore[attr-defined]
        wrapper.__rlhf_sequence__ = sequence_parallel  # type: ignore[attr-defined]
        return cast(F, wrapper)

    return decorate


def dispatch_of(role: Role, method: str) -> Dispatch:
    """The protocol declared on ``role.method``; a clear error if the method has none."""
    proto = getattr(getattr(type(role), method, None), "__rlhf_dispatch__", None)
    if proto is None:
        raise TypeError(
            f"`{type(role).__name__}.{method}` has no transfer protocol. "
            "HINT: decorate it with `@role_method(Dispatch.DP_SPLIT)` (or ONE_TO_ALL / RANK_ZERO)."
        )
    return cast(Dispatch, proto)


def sequence_parallel_of(role: Role, method: str) -> int:
    """The ranks that share each row of a ``role.method`` call: the role's ``sequence_parallel`` for a method declared
    ``sequence_parallel=True``, else 1. Runs on: controller."""
    declared = getattr(getattr(type(role), method, None), "__rlhf_sequence__", False)
    return int(getattr(role, "sequence_parallel", 1)) if declared else 1


def declares_sequence_parallel(role: Role) -> bool:
    """Whether any method of ``role`` is declared ``sequence_parallel=True``. Runs on: any process."""
    cls = type(role)
    return any(getattr(getattr(cls, name, None), "__rlhf_sequence__", False) for name in dir(cls))


def sequence_parallel_roles(
    size: int, roles: Mapping[str, Any], pools: Mapping[str, Sequence[int]], *, world_size: int
) -> dict[str, int]:
    """The roles ``RLHFModule(sequence_parallel=size)`` splits sequences for (those with a method declared
    ``sequence_parallel=True``: actor, critic, reference), each mapped to ``size``, checked against each one's ranks
    (its pool in ``pools``; without one, all ``world_size``): a group is ``size`` consecutive ranks of the pool.
    Runs on: the launching process (before any rank starts), and every process at set-up, before any model loads.

    Raises:
        ValueError: ``size`` does not divide a role's ranks (e.g. a pool smaller than ``size``), naming the role,
            its ranks and the fix.
    """
    if size == 1:
        return {}
    out = {}
    for name, role in roles.items():
        if not declares_sequence_parallel(role):
            continue
        ranks = list(pools.get(name, range(world_size)))
        n = len(ranks)
        if n % size:
            fits = [d for d in range(1, n + 1) if n % d == 0]
            if name in pools and n < world_size:
                where = f"the pool {ranks}"
                fix = f"give {name!r} a pool of a multiple of {size} ranks (RLHFStrategy(placement=...))"
            else:
                where, fix = f"all {n} ranks of the run", f"run a multiple of {size} processes (Trainer(devices=...))"
            raise ValueError(
                f"RLHFModule(sequence_parallel={size}) splits every sequence of {name!r} over {size} of its ranks, so "
                f"it must divide them; {name!r} runs on {where}. HINT: {fix}, or sequence_parallel in {fits} (1: off)."
            )
        out[name] = size
    return out


def sequence_group_of(role: Role, method: str) -> Any:
    """This rank's sequence-parallel group for a ``role.method`` call (None: the method or role has none). Runs on:
    worker."""
    return getattr(role, "sequence_group", None) if sequence_parallel_of(role, method) > 1 else None


def columns_of(role: Role, method: str) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
    """The columns ``role.method`` declares it reads and writes (None: all). Runs on: controller and workers."""
    reads, writes = getattr(getattr(type(role), method, None), "__rlhf_columns__", (None, None))
    if callable(writes):
        writes = writes(role)
    return reads, None if writes is None else tuple(writes)


def only_written(where: str, inputs: Mapping[str, Any], result: Any, writes: Sequence[str]) -> Batch:
    """What a worker sends back of a ``DP_SPLIT`` call that declares ``writes``: those columns of ``result`` (and its
    meta). ``inputs`` are the columns of the batch the method was given, as they were before the call. Runs on: worker.
    Raises when ``result`` does not have one row per input row, or adds or replaces a column it does not declare (it
    would be lost on the way back; a tensor changed in place cannot be seen)."""
    rows = len(next(iter(inputs.values()))) if inputs else 0
    if not isinstance(result, Batch) or len(result) != rows:
        got = f"{len(result)} rows" if isinstance(result, Batch) else type(result).__name__
        raise RuntimeError(
            f"`{where}` declares writes={list(writes)}, so it must return its input batch (one row per input row, "
            f"{rows} here) with those columns set; it returned {got}. HINT: set the columns on the batch it "
            "was given and return it, or declare no `writes` to send the whole result back."
        )
    missing = [k for k in writes if k not in result]
    changed = [k for k in [*result.tensors, *result.columns] if k not in inputs or result[k] is not inputs[k]]
    undeclared = [k for k in changed if k not in writes]
    if missing or undeclared:
        raise RuntimeError(
            f"`{where}` declares writes={list(writes)}, but its result "
            + (f"lacks {missing}" if missing else f"adds or replaces the undeclared columns {undeclared}")
            + ". HINT: declare every column the method adds in `@role_method(..., writes=...)`."
        )
    return Batch(
        {k: result.tensors[k] for k in writes if k in result.tensors},
        {k: result.columns[k] for k in writes if k in result.columns},
        result.meta,
    )


def with_written(caller: Batch, merged: Batch, writes: Sequence[str]) -> Batch:
    """The controller's result of a call that declares ``writes``: the caller's batch (shallow copy) with the
    written columns of the merged results set, and their meta. Runs on: controller."""
    out = Batch(caller.tensors, caller.columns, merged.meta)
    for key in writes:
        out[key] = merged[key]
    return out


def split_args(
    dispatch: Dispatch,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    world_size: int,
    *,
    where: str,
    reads: Sequence[str] | None = None,
    sequence_parallel: int = 1,
) -> list[tuple[tuple[Any, ...], dict[str, Any]] | None]:
    """Arguments for each rank (``None``: the rank skips the call); a ``DP_SPLIT`` batch holds only the columns in
    ``reads`` (None: all), split into ``world_size / sequence_parallel`` parts, each given to that many consecutive
    ranks. Runs on: controller. Raises for a ``DP_SPLIT`` call without a batch that splits evenly."""
    if dispatch is Dispatch.ONE_TO_ALL:
        return [(args, kwargs)] * world_size
    if dispatch is Dispatch.RANK_ZERO:
        return [(args, kwargs)] + [None] * (world_size - 1)
    if not args or not isinstance(args[0], Batch):
        got = type(args[0]).__name__ if args else "no positional argument"
        raise TypeError(f"{where} is DP_SPLIT: pass the Batch as its first positional argument (got {got}).")
    batch = args[0]
    if reads is not None:  # only what the method reads travels
        kept = set(reads)
        trimmed = Batch(
            {k: v for k, v in batch.tensors.items() if k in kept},
            {k: v for k, v in batch.columns.items() if k in kept},
            batch.meta,
        )
        if len(batch) and not trimmed.keys():
            raise KeyError(
                f"{where} reads {sorted(kept)}, and the batch has none of them (its columns: {sorted(batch.keys())}). "
                "HINT: pass the batch the method expects (e.g. a rollout with prompts and responses)."
            )
        batch = trimmed
    groups = world_size // sequence_parallel
    if len(batch) % groups:
        shared = f" ({world_size} / sequence_parallel={sequence_parallel})" if sequence_parallel > 1 else ""
        raise ValueError(
            f"{where}: a batch of {len(batch)} rows cannot be split evenly over {groups} ranks{shared}"
            ". HINT: make the batch size (prompts per step, and prompts x samples per prompt) a multiple of the "
            "number of ranks."
        )
    parts = _dp_parts(batch, groups)
    if sequence_parallel > 1:  # each rank of a group gets its own shallow copy (a method may set columns on it)
        parts = [Batch(p.tensors, p.columns, p.meta) for p in parts for _ in range(sequence_parallel)]
    return [((part, *args[1:]), kwargs) for part in parts]


def _mark_balance(batch: Batch, balance: bool, costs: list[int] | None = None) -> Batch:
    """``batch`` with ``meta[BALANCE_KEY] = balance`` and ``meta[COSTS_KEY] = costs`` (a shallow copy when that
    changes it)."""
    if bool(batch.meta.get(BALANCE_KEY, False)) == balance and batch.meta.get(COSTS_KEY) == costs:
        return batch
    meta = {**batch.meta, BALANCE_KEY: balance}
    if costs is None:
        meta.pop(COSTS_KEY, None)
    else:
        meta[COSTS_KEY] = costs
    return Batch(batch.tensors, batch.columns, meta)


def _dp_parts(batch: Batch, world_size: int) -> list[Batch]:
    """Each rank's part: contiguous equal chunks; or equal row counts balanced by the per-row costs of
    ``meta[COSTS_KEY]`` (whole groups of ``meta["group_size"]`` rows when the groups split evenly over the ranks);
    or, for a rollout batch marked with :data:`BALANCE_KEY`, balanced by tokens. A balanced part's rows are in batch
    order, their indices in ``meta[ROWS_KEY]``."""
    masks = [batch.tensors.get(key) for key in ("prompt_mask", "response_mask")]
    costs = batch.meta.get(COSTS_KEY)
    if world_size == 1:
        (part,) = batch.chunk(1)  # a batch of its own: a method may return it with new columns
        part.meta.pop(COSTS_KEY, None)
        return [part]
    if costs is not None:
        plan = _grouped_partition(list(costs), int(batch.meta.get("group_size", 1)), world_size)
    elif batch.meta.get(BALANCE_KEY) and not any(m is None or m.dim() != 2 for m in masks):
        lengths = sum(m.long().sum(dim=1) for m in masks if m is not None)
        assert isinstance(lengths, torch.Tensor)
        plan = balanced_partition(lengths.tolist(), world_size)
    else:
        return batch.chunk(world_size)
    parts = []
    for rows in plan:
        part = batch.select(rows)
        part.meta[ROWS_KEY] = rows
        part.meta.pop(COSTS_KEY, None)
        parts.append(part)
    return parts


def _grouped_partition(costs: list[int], group: int, parts: int) -> list[list[int]]:
    """:func:`balanced_partition` of consecutive groups of ``group`` rows (one unit each, its rows' costs summed),
    or of single rows when the groups do not split evenly over ``parts``."""
    if group < 1 or len(costs) % (group * parts):
        group = 1
    units = [sum(costs[u : u + group]) for u in range(0, len(costs), group)]
    return [[u * group + k for u in plan for k in range(group)] for plan in balanced_partition(units, parts)]


def balanced_partition(lengths: Sequence[int] | Sequence[tuple[int, ...]], parts: int) -> list[list[int]]:
    """Split rows (``lengths``: each row's tokens, or its segments' tokens) into ``parts`` groups of equal size whose
    token sums are balanced.

    Runs on: any process; deterministic. The longest-processing-time rule with a room limit per group: rows in
    descending order of length (ties: lower index) go to the group with the fewest tokens that has room (ties: lower
    group). Each group's indices come back ascending. Raises ``ValueError`` when ``parts`` does not divide the rows.
    """
    totals = [int(x) if isinstance(x, int) else int(sum(x)) for x in lengths]
    if parts < 1 or len(totals) % parts:
        raise ValueError(
            f"balanced_partition: {len(totals)} rows cannot be split into {parts} equal groups. "
            "HINT: the batch size must be a multiple of the number of ranks."
        )
    size = len(totals) // parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(totals)), key=lambda i: (-totals[i], i)):
        g = min((g for g in range(parts) if len(groups[g]) < size), key=lambda g: (load[g], g))
        groups[g].append(i)
        load[g] += totals[i]
    return [sorted(g) for g in groups]


def merge_results(dispatch: Dispatch, results: Sequence[Any]) -> Any:
    """Combine per-rank results into the controller's return value: batches concatenated (in the caller's row order
    after a balanced split), dicts of numbers averaged over the ranks that report each key (``*_max``/``*_min`` keys
    keep their extreme), anything else rank 0's. Runs on: controller.
    """
    if dispatch is not Dispatch.DP_SPLIT:
        return results[0]
    first = results[0]
    if isinstance(first, Batch):
        return _merge_batches(list(results))
    if (
        isinstance(first, dict) and len(results) > 1
    ):  # a key some ranks lack (e.g. one that trained no sample) comes from the others
        keys = dict.fromkeys(k for r in results if isinstance(r, dict) for k in r)
        return {k: _reduce(k, [r[k] for r in results if isinstance(r, dict) and k in r]) for k in keys}
    return first


def _merge_batches(results: list[Any]) -> Batch:
    """Rank results concatenated, in the caller's row order when the split was balanced; the split's meta keys
    are dropped (a later call decides its own split)."""
    rows = [r.meta.get(ROWS_KEY) if isinstance(r, Batch) else None for r in results]
    merged = results[0] if len(results) == 1 else Batch.cat(results)
    if any(r is not None for r in rows):
        bad = [
            rank for rank, (r, part) in enumerate(zip(rows, results, strict=True)) if r is None or len(r) != len(part)
        ]
        if bad:
            raise RuntimeError(
                f"A DP_SPLIT call balanced by tokens cannot put rank {bad[0]}'s result back in order: it lost its "
                f"`meta[{ROWS_KEY!r}]` or changed its row count. HINT: return the input batch (or `batch.select(...)` "
                "of it) with new columns, one row per input row, or set "
                "AlgorithmConfig.batching.micro_batch_tokens=None."
            )
        order = torch.tensor([i for r in rows for i in (r or [])])
        merged = merged.select(torch.argsort(order))
    merged.meta.pop(ROWS_KEY, None)
    merged.meta.pop(BALANCE_KEY, None)
    return merged


def _reduce(key: str, values: list[Any]) -> Any:
    """Average over ranks, except metrics named ``*_max`` / ``*_min``, which keep their extreme."""
    if isinstance(values[0], torch.Tensor):
        stacked = torch.stack([v.float() for v in values])
        if key.endswith("_max"):
            return stacked.amax(0)
        return stacked.amin(0) if key.endswith("_min") else stacked.mean(0)
    if key.endswith("_max"):
        return max(values)
    return min(values) if key.endswith("_min") else sum(values) / len(values)
