"""The single controller and the worker loop that serves it.

During one training step, rank 0 runs the module's ``training_step`` (the RL dataflow) as a plain sequential
program. Each role call it makes is sent to every rank over a dedicated gloo group (the *control plane*):
the ranks run the role method together (FSDP collectives inside it use the default group, the *data plane*)
and send their results back. Ranks other than 0 sit in :meth:`Controller.serve` for the whole step.

Failures: a role method that raises on any rank is caught there; its traceback travels back with the
results and the controller raises :class:`WorkerError`. The failing rank also posts the error to the
rendezvous store, so if the other ranks are stuck in a collective that the failed rank will never join, a
watchdog thread on every rank prints the error and ends the process after ``error_timeout_s``: the run
fails loudly instead of hanging.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from lightning_rlhf.batch import Batch
from lightning_rlhf.strategy.dispatch import controller_active, dispatch_of, merge_results, split_args

if TYPE_CHECKING:
    from lightning_rlhf.roles.base import Role

__all__ = ["Controller", "ControllerError", "WorkerError"]

_ERROR_KEY = "lightning_rlhf/error"


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


@dataclasses.dataclass
class _EndStep:
    logs: list[tuple[str, float, dict[str, Any]]]


@dataclasses.dataclass
class _Abort:
    message: str


@dataclasses.dataclass
class _Failure:
    rank: int
    where: str
    traceback: str


class Controller:
    """Routes role calls from rank 0 to all ranks and back. One instance per process.

    Args:
        roles: resolves a role name to this process's role object.
        rank: this process's global rank.
        world_size: number of processes.
        error_timeout_s: how long a rank may stay blocked after another rank posted an error before the
            watchdog ends the process.
    """

    def __init__(
        self, roles: Callable[[str], Role], *, rank: int, world_size: int, error_timeout_s: float = 60.0
    ) -> None:
        self._roles = roles
        self.rank = rank
        self.world_size = world_size
        self._group: Any = None
        self._store: Any = None
        self._watchdog: _Watchdog | None = None
        if world_size > 1:
            # Control messages are pickled Python objects: keep them on a CPU (gloo) group whatever the
            # data-plane backend is, so NCCL never carries them and GPU tensors never enter them.
            self._group = dist.new_group(backend="gloo")
            self._store = dist.distributed_c10d._get_default_store()
            self._watchdog = _Watchdog(self._store, rank, error_timeout_s)

    # ----------------------------------------------------------------------------------- controller
    def run_step(self, step_fn: Callable[[], Any], logs: list[tuple[str, float, dict[str, Any]]]) -> Any:
        """Run ``step_fn`` (the module's training or validation step) as the controller, then release the workers.

        Runs on: controller (rank 0). ``logs`` is filled by the module while the step runs and is replayed
        on the workers, so every rank sees the same logged metrics (callbacks that monitor them work).
        """
        try:
            with controller_active(self):
                out = step_fn()
        except BaseException as err:
            if self.world_size > 1 and not isinstance(err, WorkerError):
                self._post_error(f"controller (rank 0) failed:\n{traceback.format_exc()}")
            self._scatter([_Abort(repr(err))] * self.world_size)
            raise
        self._scatter([_EndStep(logs)] * self.world_size)
        return out

    def call(self, role: Role, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Distribute one role call by its declared protocol and return the merged result.

        Runs on: controller (rank 0), from inside a role method called in a training or validation step.
        """
        where = f"{role.name}.{method}"
        dispatch = dispatch_of(role, method)
        per_rank = split_args(dispatch, args, kwargs, self.world_size, where=where)
        messages = [None if a is None else _Call(role.name, method, a[0], a[1]) for a in per_rank]
        with self._busy():
            mine = self._scatter(messages)
            result = self._execute(mine) if mine is not None else None
            results = self._gather(result)
        failures = [r for r in results if isinstance(r, _Failure)]
        if failures:
            first = self._first_posted_failure() or failures[0]
            raise WorkerError(first.rank, first.where, first.traceback)
        return merge_results(dispatch, [r for r, a in zip(results, per_rank, strict=True) if a is not None])

    # ---------------------------------------------------------------------------------------- worker
    def serve(self, replay_log: Callable[[str, float, dict[str, Any]], None]) -> None:
        """Serve the controller's role calls until it ends the step.

        Runs on: workers (ranks > 0), once per training step and once per validation batch.
        """
        while True:
            with self._busy():
                msg = self._scatter(None)
            if isinstance(msg, _EndStep):
                for name, value, kw in msg.logs:
                    replay_log(name, value, kw)
                return
            if isinstance(msg, _Abort):
                raise ControllerError(
                    f"rank {self.rank}: the controller's step failed ({msg.message}); it raises the error."
                )
            with self._busy():
                self._gather(self._execute(msg) if msg is not None else None)

    # -------------------------------------------------------------------------------------- plumbing
    def _execute(self, call: _Call) -> Any:
        role = self._roles(call.role)
        fn = getattr(type(role), call.method).__wrapped__
        where = f"{call.role}.{call.method}"
        try:
            with controller_active(None):
                result = fn(role, *call.args, **call.kwargs)
        except Exception:
            tb = traceback.format_exc()
            self._post_error(f"rank {self.rank} failed in `{where}`:\n{tb}", _Failure(self.rank, where, tb))
            return _Failure(self.rank, where, tb)
        return result.to("cpu") if isinstance(result, Batch) and self.world_size > 1 else result

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

    def _post_error(self, message: str, failure: _Failure | None = None) -> None:
        """Publish the first error of the run (later ones keep the first) for every rank's watchdog."""
        if self._store is None:
            return
        payload = pickle.dumps((message, failure))
        with contextlib.suppress(Exception):  # the store may already be gone at shutdown
            self._store.compare_set(_ERROR_KEY, "", payload)

    def _first_posted_failure(self) -> _Failure | None:
        if self._store is None:
            return None
        try:
            if not self._store.check([_ERROR_KEY]):
                return None
            _, failure = pickle.loads(self._store.get(_ERROR_KEY))
        except Exception:
            return None
        return failure if isinstance(failure, _Failure) else None

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

    def close(self) -> None:
        """Stop the watchdog. Runs on: every rank, at teardown."""
        if self._watchdog is not None:
            self._watchdog.stop()


class _Watchdog:
    """Ends this process if another rank posted an error and this one stays blocked past the timeout.

    "Blocked" means inside a role call or waiting for the controller (``busy``); a rank that is shutting down
    cleanly elsewhere gets three times as long before it is ended.
    """

    def __init__(self, store: Any, rank: int, timeout_s: float, poll_s: float = 0.5) -> None:
        self._store = store
        self._rank = rank
        self._timeout_s = timeout_s
        self._poll_s = poll_s
        self._stop = threading.Event()
        self.busy = False
        self._thread = threading.Thread(target=self._run, name="lightning_rlhf-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # leave no thread inside a store call while the interpreter shuts down

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self._poll_s + 1)

    def _run(self) -> None:
        seen_at: float | None = None
        while not self._stop.wait(self._poll_s):
            try:
                posted = self._store.check([_ERROR_KEY])
            except Exception:  # rank 0's store is gone: the run is over, do not linger
                posted = seen_at is not None
                if not posted:
                    return
            if not posted:
                continue
            seen_at = seen_at or time.monotonic()
            if time.monotonic() - seen_at < self._timeout_s * (1 if self.busy else 3):
                continue
            try:
                message, _ = pickle.loads(self._store.get(_ERROR_KEY))
            except Exception:
                message = "another rank failed (its message could not be read)"
            print(
                f"\n[lightning_rlhf] rank {self._rank}: blocked {self._timeout_s:.0f}s after an error elsewhere; "
                f"ending this process.\n{message}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
