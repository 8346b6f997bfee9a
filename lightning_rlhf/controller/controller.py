"""The single controller and the worker loop that serves it (docs/architecture.md: "One controller, W workers",
"Control plane and data plane", "Failures").

During a step, rank 0 runs the module's ``training_step`` as a plain program; each role call goes over a gloo group
(the control plane) to the ranks of the role's pool, which run it together and send back their results, while the
other ranks sit in :meth:`Controller.serve`. Each exchange carries a list of calls per rank, so the calls of a
``concurrently()`` block to disjoint pools run at the same time; a background call (``in_background()``) runs in a
thread on each rank until the controller sends its join. A role method that raises becomes :class:`WorkerError` on
the controller; the error is also posted to the rendezvous store for the watchdog (:mod:`.liveness`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import pickle
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lightning_rlhf.batch import Batch
from lightning_rlhf.controller.dispatch import (
    Dispatch,
    Role,
    columns_of,
    controller_active,
    data_parallel_group,
    dispatch_of,
    merge_results,
    only_written,
    sequence_group_of,
    sequence_parallel_of,
    split_args,
    with_written,
)
from lightning_rlhf.controller.host_memory import release_free_heap
from lightning_rlhf.controller.liveness import ERROR_KEY, STOP_KEY, Liveness, RankDiedError, Watchdog

__all__ = ["Controller", "ControllerError", "RankDiedError", "WorkerError"]

_COMM_ERROR_WORDS = ("connection", "gloo", "nccl", "socket", "broken pipe", "timed out", "peer")


class WorkerError(RuntimeError):
    """A role method raised on a worker rank. Raised on the controller, carrying that rank's traceback."""

    def __init__(self, rank: int, where: str, remote_traceback: str) -> None:
        self.rank = rank
        self.where = where
        self.remote_traceback = remote_traceback
        last = remote_traceback.strip().splitlines()[-1] if remote_traceback.strip() else ""
        super().__init__(
            f"rank {rank} failed in `{where}`: {last}\n\n--- traceback on rank {rank} ---\n{remote_traceback}"
        )


class ControllerError(RuntimeError):
    """Raised on worker ranks when the controller's step failed; the controller raises the real error."""


@dataclasses.dataclass
class _Call:
    role: str
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    index: int = 0  # position of the call in its exchange
    token: int | None = None  # set: start the call in a thread and reply at once (a background call)


@dataclasses.dataclass
class _Plan:
    """How one call of an exchange went out: its protocol, the ranks that got a part (in pool order), and for a call
    that declares ``writes`` the caller's batch and those columns (its result is that batch with them set)."""

    dispatch: Dispatch
    ranks: list[int]
    caller: Batch | None = None
    writes: tuple[str, ...] | None = None
    sequence_parallel: int = 1  # each group of this many consecutive ranks had the same rows: its first rank's counts

    def merge(self, results: Sequence[Any]) -> Any:
        """The controller's result from the ranks' results, in :attr:`ranks` order."""
        merged = merge_results(self.dispatch, list(results)[:: self.sequence_parallel])
        if self.writes is None or self.caller is None:
            return merged
        return with_written(self.caller, merged, self.writes)


def _batch_argument(args: tuple[Any, ...]) -> Batch | None:
    """The batch a ``DP_SPLIT`` call splits (its first positional argument), or None."""
    return args[0] if args and isinstance(args[0], Batch) else None


@dataclasses.dataclass
class _Join:
    token: int  # the background call to wait for
    index: int = 0


_STARTED = "started"


@dataclasses.dataclass
class _EndStep:
    logs: list[tuple[str, float, dict[str, Any]]]
    stop: int = 0  # signal number of a stop requested on any rank: every rank stops after this step


@dataclasses.dataclass
class _Abort:
    message: str


@dataclasses.dataclass
class _Failure:
    rank: int
    where: str
    traceback: str


def _post_error(store: Any, message: str, failure: _Failure | None = None) -> None:
    """Publish the first error of the run in ``store`` (later ones keep the first) for every rank's watchdog."""
    if store is None:
        return
    payload = pickle.dumps((message, failure))
    with contextlib.suppress(Exception):  # the store may already be gone at shutdown
        store.compare_set(ERROR_KEY, "", payload)


def _first_posted_failure(store: Any) -> _Failure | None:
    if store is None:
        return None
    try:
        if not store.check([ERROR_KEY]):
            return None
        _, failure = pickle.loads(store.get(ERROR_KEY))
    except Exception:
        return None
    return failure if isinstance(failure, _Failure) else None


class _BackgroundParts:
    """This rank's background parts of role calls (``in_background()``): each runs in a thread of this process, its
    result waiting in a box for the join. Runs on: any rank."""

    def __init__(self) -> None:
        self._threads: dict[int, tuple[threading.Thread, list[tuple[Any, float]]]] = {}

    def start(self, call: _Call, execute: Callable[[], Any], rank: int) -> None:
        """Run ``execute()`` (``call``'s part) in a thread; a raised error becomes the result as a :class:`_Failure`."""
        box: list[tuple[Any, float]] = []
        grad = torch.is_grad_enabled()  # per thread in torch, as the current CUDA device is: carry both over
        device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

        def run() -> None:
            started = time.perf_counter()
            if device is not None:
                torch.cuda.set_device(device)
            try:
                with torch.set_grad_enabled(grad):
                    result = execute()
            except BaseException as err:  # e.g. a dead peer: the join reports it like a failed call
                result = _Failure(rank, f"{call.role}.{call.method}", "".join(traceback.format_exception(err)))
            box.append((result, time.perf_counter() - started))

        thread = threading.Thread(target=run, name=f"lightning_rlhf {call.role}.{call.method}", daemon=True)
        self._threads[call.token or 0] = (thread, box)
        thread.start()

    def join(self, token: int) -> tuple[Any, float]:
        """Wait for the part started with ``token``: its result and its seconds."""
        thread, box = self._threads.pop(token)
        thread.join()
        return box[0]

    def drop(self, wait_s: float = 30.0) -> None:
        """After a failed step: wait (a bounded time) for the parts and forget them, so that a later step does not
        find a thread still using a role."""
        deadline = time.monotonic() + wait_s
        for thread, _ in self._threads.values():
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads.clear()


log = logging.getLogger(__name__)
CALL_LOG_ENV = "LIGHTNING_RLHF_CALL_LOG"
"""Environment variable: a file each rank appends a line to per role call (rank, call, start and end time, memory),
for lining up samples taken from outside the processes (``benchmarks/rss_sampler.py``)."""


def _log_calls_to(path: str | None) -> None:
    """Send this module's DEBUG lines (one per role call) to ``path`` (appended; once per process)."""
    if not path or any(getattr(h, "baseFilename", None) == os.path.abspath(path) for h in log.handlers):
        return
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)


_NO_WINDOW = contextlib.nullcontext[dict[str, float]]({})
"""The default ``call_window``: measures nothing (its dict stays empty)."""


class Controller:
    """Routes role calls from rank 0 to all ranks and back. One instance per process.

    ``error_timeout_s``: how long a rank may stay blocked after another rank posted an error before the watchdog
    ends the process; also how long a rank on another host may miss heartbeats. ``children``: this process's child
    processes that are ranks (their exit status names how they died). ``pools``: each role's ranks (a role not named
    is on every rank); ``groups``: each role's data-parallel group on this rank. ``reply_stats``: what each rank
    reports with every reply (kept per rank in :attr:`memory_peaks`); ``call_window``: a context manager around each
    role call on each rank, whose dict (the call's memory) the controller keeps in :attr:`call_memory`.
    """

    def __init__(
        self,
        roles: Callable[[str], Role],
        *,
        rank: int,
        world_size: int,
        error_timeout_s: float = 60.0,
        children: list[subprocess.Popen[Any]] | None = None,
        stop_requested: Callable[[], int] = lambda: 0,
        pools: Mapping[str, Sequence[int]] | None = None,
        groups: Mapping[str, Any] | None = None,
        reply_stats: Callable[[], dict[str, float]] = dict,
        call_window: Callable[[], contextlib.AbstractContextManager[dict[str, float]]] = lambda: _NO_WINDOW,
    ) -> None:
        self._roles = roles
        _log_calls_to(os.environ.get(CALL_LOG_ENV))
        self._reply_stats = reply_stats
        self._call_window = call_window
        self._pools = {role: tuple(ranks) for role, ranks in (pools or {}).items()}
        self._groups = dict(groups or {})
        self.rank = rank
        self.world_size = world_size
        self._group: Any = None
        self._store: Any = None
        self._watchdog: Watchdog | None = None
        self._liveness: Liveness | None = None
        self._stop_requested = stop_requested
        self.where: str | None = None  # the role call in flight on this rank
        self._last_where: str | None = None
        self.stop_signum = 0  # set after each step: the stop every rank agreed on (0: go on)
        self.last_seconds: list[float] = []  # each call of the last exchange: its time on its slowest rank
        self.memory_peaks: dict[int, dict[str, float]] = {}  # each rank's reply_stats(), at its latest reply
        # each role call ("actor.update") -> rank -> its perf.memory_window(), since the metrics last took them
        self.call_memory: dict[str, dict[int, dict[str, float]]] = {}
        # controller: each background call -> where, its plan
        self._in_flight: dict[int, tuple[str, _Plan]] = {}
        self._next_token = 0
        self._background = _BackgroundParts()  # this rank's background parts
        if world_size > 1:
            # Control messages are pickled Python objects: keep them on a CPU (gloo) group whatever the
            # data-plane backend is, so NCCL never carries them and GPU tensors never enter them.
            self._group = dist.new_group(backend="gloo")
            self._store = dist.distributed_c10d._get_default_store()
            self._liveness = Liveness(
                self._store, rank, world_size, children=children, heartbeat_timeout_s=error_timeout_s
            )
            self._liveness.publish()
            self._liveness.where = self.describe_where
            self._watchdog = Watchdog(
                self._store,
                rank,
                error_timeout_s,
                liveness=self._liveness,
                stop_flag=stop_requested,
                grace_s=min(10.0, error_timeout_s),
            )

    def describe_where(self) -> str | None:
        """The role call this rank has in flight, or the last one it served. Runs on: any rank."""
        if self.where is not None:
            return self.where
        if self._last_where is not None:
            return f"the wait for the next role call (after `{self._last_where}`)"
        return None

    # ----------------------------------------------------------------------------------- controller
    def run_step(
        self, step_fn: Callable[[], Any], logs: list[tuple[str, float, dict[str, Any]]], *, track_stop: bool = False
    ) -> Any:
        """Run ``step_fn`` (the module's training or validation step) as the controller, then release the workers.
        Runs on: controller (rank 0). ``logs``, filled by the module during the step, is replayed on the workers; with
        ``track_stop`` (training steps) the end-of-step message carries the stop decision (``stop_signum``)."""
        self._last_where = None
        try:
            with controller_active(self):
                out = step_fn()
            self._check_background_read()
        except BaseException as err:
            self._in_flight.clear()
            self._background.drop()
            if isinstance(err, RankDiedError):  # the control plane is broken: no abort can reach every rank
                raise
            if self.world_size > 1 and not isinstance(err, WorkerError):
                _post_error(self._store, f"controller (rank 0) failed:\n{traceback.format_exc()}")
            abort = [_Abort(repr(err))] * self.world_size
            self._communicate(lambda: self._scatter(abort))
            raise
        self.stop_signum = self._decide_stop() if track_stop else 0
        self._communicate(lambda: self._scatter([_EndStep(logs, self.stop_signum)] * self.world_size))
        return out

    def _decide_stop(self) -> int:
        """A stop asked of rank 0 itself, or posted to the store by another rank (the first one wins)."""
        signum = self._stop_requested()
        if signum or self._store is None:
            return signum
        try:
            return int(self._store.get(STOP_KEY)) if self._store.check([STOP_KEY]) else 0
        except Exception:
            return 0

    def pool(self, role: str) -> tuple[int, ...]:
        """The ranks that hold ``role``. Runs on: any rank."""
        return self._pools.get(role) or tuple(range(self.world_size))

    def call(self, role: Role, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Distribute one role call by its declared protocol over the role's pool and return the merged result.
        Runs on: controller (rank 0), from inside a role method called in a training or validation step."""
        return self.call_many([(role, method, args, kwargs)])[0]

    def call_many(self, calls: Sequence[tuple[Role, str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """Run several role calls in one exchange (each rank runs its parts in order) and return their merged results.

        Runs on: controller (rank 0), at the end of a ``concurrently()`` block (or for one call). A failure on any rank
        raises :class:`WorkerError` after every rank has answered. ``last_seconds`` then holds each call's time on its
        slowest rank.
        """
        messages, plans, where = self._plan(calls, background=False)
        by_call, self.last_seconds = self._exchange(messages, len(calls), where)
        return [plan.merge([by_call[index][rank] for rank in plan.ranks]) for index, plan in enumerate(plans)]

    def start_many(self, calls: Sequence[tuple[Role, str, tuple[Any, ...], dict[str, Any]]]) -> list[int]:
        """Start role calls in the background (``in_background()``); one handle per call for :meth:`join`. Runs on:
        controller (rank 0). The ranks of a started call take no other call until it is joined."""
        messages, plans, where = self._plan(calls, background=True)
        self._exchange(messages, len(calls), where)
        tokens = list(range(self._next_token, self._next_token + len(calls)))
        for token, (role, method, *_), plan in zip(tokens, calls, plans, strict=True):
            self._in_flight[token] = (f"{role.name}.{method}", plan)
        self._next_token += len(calls)
        return tokens

    def join(self, token: int) -> tuple[Any, float]:
        """Wait for a background call on every rank of its pool; its merged result and its time on the slowest rank.
        Runs on: controller (rank 0), from :meth:`~lightning_rlhf.controller.dispatch.RoleFuture.result`."""
        where, plan = self._in_flight.pop(token)
        messages: list[list[Any]] = [[] for _ in range(self.world_size)]
        for rank in plan.ranks:
            messages[rank].append(_Join(token))
        by_call, seconds = self._exchange(messages, 1, f"{where} (waiting for it)")
        return plan.merge([by_call[0][rank] for rank in plan.ranks]), seconds[0]

    def _plan(
        self, calls: Sequence[tuple[Role, str, tuple[Any, ...], dict[str, Any]]], *, background: bool
    ) -> tuple[list[list[Any]], list[_Plan], str]:
        """Each rank's parts of ``calls``, each call's :class:`_Plan`, and how the exchange is named."""
        busy = {rank: where for where, plan in self._in_flight.values() for rank in plan.ranks}
        messages: list[list[Any]] = [[] for _ in range(self.world_size)]
        plans: list[_Plan] = []
        for index, (role, method, args, kwargs) in enumerate(calls):
            where = f"{role.name}.{method}"
            dispatch = dispatch_of(role, method)
            pool = self.pool(role.name)
            taken = [rank for rank in pool if rank in busy]
            if taken:
                raise RuntimeError(
                    f"`{where}` goes to ranks {list(pool)}, but rank {taken[0]} is still running `{busy[taken[0]]}`, "
                    "started in the background. HINT: read that call's `.result()` first, or place the two roles on "
                    "disjoint ranks."
                )
            reads, writes = columns_of(role, method)  # declared on DP_SPLIT methods only (role_method checks)
            sp = sequence_parallel_of(role, method)
            per_rank = split_args(dispatch, args, kwargs, len(pool), where=where, reads=reads, sequence_parallel=sp)
            ranks = [rank for rank, part in zip(pool, per_rank, strict=True) if part is not None]
            token = self._next_token + index if background else None
            if background:  # one background call per rank at a time
                busy |= {rank: where for rank in ranks}
            for rank, part in zip(pool, per_rank, strict=True):
                if part is not None:
                    messages[rank].append(_Call(role.name, method, part[0], part[1], index, token))
            caller = _batch_argument(args) if writes is not None else None
            if caller is not None:  # as it is now: columns set on it before a background call is read stay out
                caller = Batch(caller.tensors, caller.columns, caller.meta)
            plans.append(_Plan(dispatch, ranks, caller, writes, sp))
        return messages, plans, " + ".join(f"{role.name}.{method}" for role, method, *_ in calls)

    def _exchange(self, messages: list[list[Any]], count: int, where: str) -> tuple[list[dict[int, Any]], list[float]]:
        """Send each rank its list, run rank 0's own part, gather the replies: per call, each rank's result; per
        call, its time on its slowest rank. Raises :class:`WorkerError` when any rank failed."""

        def exchange() -> list[Any]:
            return self._gather((self._execute_all(self._scatter(messages)), self._reply_stats()))

        self.where = where
        try:
            with self._busy():
                replies = self._communicate(exchange)
        finally:
            self.where, self._last_where = None, where
        by_call: list[dict[int, Any]] = [{} for _ in range(count)]
        seconds = [0.0] * count
        failures = []
        names = where.split(" + ")
        for rank, (reply, peaks) in enumerate(replies):
            self.memory_peaks[rank] = peaks
            for index, result, took, memory in reply or []:
                if memory and len(names) == count:  # the call's peak on this rank (the highest if called again)
                    kept = self.call_memory.setdefault(names[index], {}).get(rank)
                    if kept is None or memory.get("peak", 0.0) >= kept.get("peak", 0.0):
                        self.call_memory[names[index]][rank] = memory
                if isinstance(result, _Failure):
                    failures.append(result)
                by_call[index][rank] = result
                seconds[index] = max(seconds[index], took)
        if failures:
            first = _first_posted_failure(self._store) or failures[0]
            raise WorkerError(first.rank, first.where, first.traceback)
        return by_call, seconds

    def _check_background_read(self) -> None:
        """At the end of a step: every background call must have been read. Waits for the ones that were not (so
        that every rank is free again) and raises naming them."""
        if not self._in_flight:
            return
        unread = [where for where, _ in self._in_flight.values()]
        for token in list(self._in_flight):
            self.join(token)
        raise RuntimeError(
            f"The step ended with {unread} still running in the background: its result was never read, so the work "
            "would be lost. HINT: call `.result()` on every future an `in_background()` block returned before the "
            "step ends."
        )

    # ---------------------------------------------------------------------------------------- worker
    def serve(self, replay_log: Callable[[str, float, dict[str, Any]], None]) -> None:
        """Serve the controller's role calls until it ends the step. Runs on: workers (ranks > 0), once per training
        step and once per validation batch."""
        self._last_where = None
        while True:
            with self._busy():
                msg = self._communicate(lambda: self._scatter(None))
            if isinstance(msg, _EndStep):
                self.stop_signum = msg.stop
                for name, value, kw in msg.logs:
                    replay_log(name, value, kw)
                return
            if isinstance(msg, _Abort):
                self._background.drop()
                raise ControllerError(
                    f"rank {self.rank}: the controller's step failed ({msg.message}); it raises the error."
                )
            with self._busy():
                result = self._execute_all(msg or [])
                if self._watchdog is not None:
                    self._watchdog.post_stop()  # before the reply: rank 0 sees it at the end of this step
                self._communicate(functools.partial(self._gather, (result, self._reply_stats())))

    # -------------------------------------------------------------------------------------- plumbing
    def _execute_all(self, calls: list[Any]) -> list[tuple[int, Any, float, dict[str, float]]]:
        """Run this rank's parts of an exchange's calls in order (a background part starts in a thread; a join waits
        for one); after a failure the rest are skipped (the other ranks of that pool learn of it from the posted
        error)."""
        results: list[tuple[int, Any, float, dict[str, float]]] = []
        for call in calls:
            if isinstance(call, _Join):
                result, took = self._background.join(call.token)
                if isinstance(result, _Failure):  # posted now, not when it failed: until the join nobody waits on it
                    _post_error(
                        self._store, f"rank {self.rank} failed in `{result.where}`:\n{result.traceback}", result
                    )
                results.append((call.index, result, took, {}))
            elif call.token is not None:
                self._background.start(call, functools.partial(self._execute, call, background=True), self.rank)
                results.append((call.index, _STARTED, 0.0, {}))
                continue
            else:
                started, wall = time.perf_counter(), time.time()
                with self._call_window() as memory:  # a background call's memory is not told apart from the others'
                    result = self._execute(call)
                    release_free_heap()  # the call's freed host memory back to the system (controller/host_memory.py)
                took = time.perf_counter() - started
                results.append((call.index, result, took, memory))
                if log.isEnabledFor(logging.DEBUG):  # what benchmarks/rss_sampler.py lines its samples up with
                    where = f"{call.role}.{call.method}"
                    log.debug("rank %d ran %s from %.3f to %.3f %s", self.rank, where, wall, wall + took, memory)
            if isinstance(result, _Failure):
                break
        return results

    def _execute(self, call: _Call, *, background: bool = False) -> Any:
        role = self._roles(call.role)
        fn = getattr(type(role), call.method).__wrapped__
        where = f"{call.role}.{call.method}"
        if not background:
            self.where = where
        try:
            _, writes = columns_of(role, call.method)
            part = _batch_argument(call.args) if writes is not None else None
            inputs = {**part.tensors, **part.columns} if part is not None else {}  # the columns before the call
            with (
                controller_active(None),
                data_parallel_group(self._groups.get(call.role), sequence_group_of(role, call.method)),
            ):
                result = fn(role, *call.args, **call.kwargs)
            if writes is not None and part is not None:  # only what the method wrote goes back
                result = only_written(where, inputs, result, writes)
        except Exception as err:
            died = self._dead_peer(err)
            if died is not None:  # a collective failed because a peer died: not this role's fault
                raise died from err
            tb = traceback.format_exc()
            if not background:  # a background call's failure is posted when it is joined (see `_execute_all`)
                _post_error(self._store, f"rank {self.rank} failed in `{where}`:\n{tb}", _Failure(self.rank, where, tb))
            return _Failure(self.rank, where, tb)
        finally:
            if not background:
                self.where, self._last_where = None, where
        return result.to("cpu") if isinstance(result, Batch) and self.world_size > 1 else result

    def _communicate(self, fn: Callable[[], Any]) -> Any:
        """Run a control-plane exchange; a failure caused by a dead rank becomes :class:`RankDiedError`."""
        try:
            return fn()
        except Exception as err:
            died = self._dead_peer(err)
            if died is not None:
                raise died from err
            raise

    def _dead_peer(self, err: BaseException) -> RankDiedError | None:
        """The dead rank behind ``err``, if any: waits a few seconds to learn it when ``err`` looks like a
        broken connection (the backend usually notices before the watchdog does)."""
        if self._liveness is None or isinstance(err, RankDiedError):
            return None
        text = f"{type(err).__name__} {err}".lower()
        comm = isinstance(err, getattr(dist, "DistError", ())) or any(w in text for w in _COMM_ERROR_WORDS)
        death = self._liveness.wait_for_death(10.0 if comm else 0.0)
        return None if death is None else RankDiedError(death, self.describe_where())

    def _scatter(self, messages: list[Any] | None) -> Any:
        if self.world_size == 1:
            return messages[0] if messages else None
        out: list[Any] = [None]
        dist.scatter_object_list(out, messages if self.rank == 0 else None, src=0, group=self._group)
        return out[0]

    def _gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, gathered, dst=0, group=self._group)
        return gathered or []

    @contextlib.contextmanager
    def _busy(self) -> Iterator[None]:
        """Mark this rank as inside a control-plane exchange (where a dead peer would block it forever)."""
        if self._watchdog is not None:
            self._watchdog.busy = True
        try:
            yield
        finally:
            if self._watchdog is not None:
                self._watchdog.busy = False

    @property
    def death(self) -> Any:
        """The dead rank this process saw (a :class:`~lightning_rlhf.controller.liveness.Death`), or None."""
        return None if self._liveness is None else self._liveness.death

    def close(self) -> None:
        """Stop the watchdog, unless a rank died: then it stays to end this process if the shutdown hangs. Runs on:
        every rank, at teardown."""
        if self._watchdog is not None and self.death is None:
            self._watchdog.stop()
