"""Tool calls in worker processes, each with a timeout, that never crash or stall a rollout.

The rollout's process (a trainer rank, or an engine server's client) runs vLLM, gloo and OpenMP threads, so a tool
never runs in it and it is never forked: tools run in tool workers, the reward workers' program
(:mod:`lightning_rlhf.rewards.pool`) serving a mapping of tool names to functions. Each of ``num_workers`` threads
owns one worker; :meth:`ToolExecutor.submit` hands a call to a free thread and returns at once with a future, so an
episode whose observation is ready goes on while another's tool still runs.

A tool that raises, returns something with no text form, hangs past ``timeout_s`` or kills its process gives an
error observation (the worker is replaced); the result says which, for the rollout's counters.
"""

from __future__ import annotations

import atexit
import contextlib
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from subprocess import Popen
from typing import Any

from lightning_rlhf.agents.parsing import ToolCall
from lightning_rlhf.rewards.pool import STARTUP_TIMEOUT_S, kill_worker, spawn_worker, worker_payload

__all__ = ["ToolExecutor", "ToolResult"]


@dataclass(frozen=True)
class ToolResult:
    """What a call gave: ``text`` (the observation's content), ``kind`` (``ok``, ``invalid_call``, ``raised``,
    ``invalid_result``, ``timeout``, ``crash``) and the call's ``seconds``."""

    text: str
    kind: str
    seconds: float

    @property
    def ok(self) -> bool:
        """Whether the tool ran and returned a value. Runs on: any process."""
        return self.kind == "ok"


class _Worker:
    """One tool worker process, owned by one thread of the executor."""

    def __init__(self, payload: bytes) -> None:
        self.proc: Popen[bytes]
        self.conn: Connection
        self.proc, self.conn = spawn_worker(payload)
        self.ready = False

    def close(self, *, term: bool) -> str:
        self.conn.close()
        return kill_worker(self.proc, term=term)


class ToolExecutor:
    """Runs tool calls in ``num_workers`` worker processes, at most ``timeout_s`` seconds each.

    Runs on: the process that runs the rollout (a worker rank); its tool workers are child processes, started on
    first use (or by :meth:`start`) and kept across steps. ``max_chars`` cuts a long result.

    Raises:
        TypeError: the tools cannot be pickled for their workers (they hold a lock, a socket, a model...).
    """

    def __init__(
        self,
        functions: Mapping[str, Callable[..., Any]],
        *,
        timeout_s: float = 10.0,
        num_workers: int = 4,
        max_chars: int = 2000,
    ) -> None:
        import cloudpickle

        if not timeout_s > 0 or num_workers < 1:
            raise ValueError(
                f"ToolExecutor(timeout_s={timeout_s}, num_workers={num_workers}): both must be positive. HINT: "
                "RolloutConfig(tool_timeout_s=10, tool_workers=4)."
            )
        try:
            fn_bytes = cloudpickle.dumps(dict(functions))
        except Exception as err:
            raise TypeError(
                f"the tools {sorted(functions)} cannot be sent to their worker processes: cloudpickle failed with "
                f"{type(err).__name__}: {err}. HINT: create clients, locks and models inside the tool function (or "
                "in a module it imports) rather than capturing them."
            ) from err
        self.names = sorted(functions)
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self.num_workers = num_workers
        self._payload = worker_payload("tool", fn_bytes, next(iter(functions.values()), None))
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="lightning-rlhf-tool")
        self._local = threading.local()
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self.started = 0
        self.closed = False
        _EXECUTORS.add(self)

    def start(self) -> None:
        """Start the workers now (the first calls would otherwise wait for them). Runs on: the rollout's process."""
        for _ in range(self.num_workers):
            self._threads.submit(self._worker)

    def submit(self, call: ToolCall) -> Future[ToolResult]:
        """Run ``call`` (its arguments already checked) in a tool worker; the future never raises.
        Runs on: the rollout's process, any thread."""
        if self.closed:
            raise RuntimeError("the tool executor is closed. HINT: make a new one.")
        return self._threads.submit(self._run, call.name, call.arguments)

    def close(self) -> None:
        """End the threads and every worker (and what its tools started). Idempotent. Runs on: the rollout's
        process, at teardown and at interpreter exit."""
        if self.closed:
            return
        self.closed = True
        self._threads.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            workers, self._workers = self._workers, []
        for w in workers:
            w.close(term=True)

    # ------------------------------------------------------------------------------------------ private
    def _worker(self) -> _Worker:
        """This thread's worker, started (and waited for, up to the start-up bound) when it has none."""
        w: _Worker | None = getattr(self._local, "worker", None)
        if w is None:
            w = _Worker(self._payload)
            with self._lock:
                self._workers.append(w)
                self.started += 1
            self._local.worker = w
        if not w.ready:
            try:
                if not w.conn.poll(STARTUP_TIMEOUT_S):
                    raise TimeoutError(f"a tool worker did not start within {STARTUP_TIMEOUT_S:g} s")
                msg = pickle.loads(w.conn.recv_bytes())
            except Exception:
                self._drop(w)
                raise
            if msg[0] != "ready":
                self._drop(w)
                raise RuntimeError(f"the tools could not be loaded in their worker: {msg[1]}\n{msg[2]}")
            w.ready = True
        return w

    def _drop(self, w: _Worker) -> str:
        with self._lock:
            if w in self._workers:
                self._workers.remove(w)
        self._local.worker = None
        return w.close(term=True)

    def _run(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        start = time.monotonic()

        def result(text: str, kind: str) -> ToolResult:
            return ToolResult(text, kind, time.monotonic() - start)

        try:
            w = self._worker()
        except Exception as err:
            return result(f"error: the tool {name} could not run ({err})", "crash")
        start = time.monotonic()  # the timeout counts from the moment a started worker takes the call
        try:
            w.conn.send_bytes(pickle.dumps((name, arguments, self.max_chars)))
            if not w.conn.poll(self.timeout_s):
                self._drop(w)
                return result(f"error: the tool {name} timed out after {self.timeout_s:g} s", "timeout")
            kind, _, text, _ = pickle.loads(w.conn.recv_bytes())
        except (EOFError, OSError):
            how = self._drop(w)
            return result(f"error: the tool {name} crashed (its process ended: {how})", "crash")
        if kind == "ok":
            return result(text, "ok")
        if kind == "raised":
            return result(f"error: the tool {name} raised {text}", "raised")
        return result(f"error: the tool {name} returned a value the model cannot read: {text}", "invalid_result")


_EXECUTORS: weakref.WeakSet[ToolExecutor] = weakref.WeakSet()


@atexit.register
def _close_executors() -> None:
    for executor in list(_EXECUTORS):
        with contextlib.suppress(Exception):
            executor.close()
