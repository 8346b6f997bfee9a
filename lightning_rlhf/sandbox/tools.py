"""Tool calls in sandbox worker processes, each with a timeout, that never crash or stall a rollout.

Tools run in tool workers, the sandbox's worker program (:mod:`lightning_rlhf.sandbox.worker`, the one reward
functions run in) serving a mapping of tool names to functions: one worker per executor thread, and one more whose
event loop runs every ``async def`` tool call at once (docs/architecture.md). A tool that raises, returns something
with no text form, hangs past ``timeout_s`` or kills its process gives an error observation (the worker is
replaced); the result says which.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import itertools
import math
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from subprocess import Popen
from typing import Any, Protocol

from lightning_rlhf.sandbox.process import STARTUP_TIMEOUT_S, Worker, kill_worker, spawn_worker, worker_payload

__all__ = ["ToolCallLike", "ToolExecutor", "ToolResult", "tool_result"]


class ToolCallLike(Protocol):
    """A call the model wrote, as the executor reads it: the tool's ``name`` and its ``arguments`` (already checked).
    ``lightning_rlhf.agents.ToolCall`` is one; the sandbox does not import the agents."""

    @property
    def name(self) -> str: ...

    @property
    def arguments(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ToolResult:
    """What a call gave: ``text`` (the observation's content), ``kind`` (``ok``, ``raised``, ``invalid_result``,
    ``timeout``, ``crash``), the call's ``seconds``, and the ``images`` an in-process tool returned (PIL images)."""

    text: str
    kind: str
    seconds: float
    images: tuple[Any, ...] = ()


_COROUTINE_GRACE_S = 2.0
"""Seconds past a coroutine's timeout after which its worker counts as blocked (a tool that blocks the event loop,
e.g. with ``time.sleep``, stops ``wait_for`` from cancelling it): the worker is then killed and replaced."""


def tool_result(name: str, kind: str, text: str, seconds: float) -> ToolResult:
    """How a call of tool ``name`` ended, as the observation the model reads. ``kind``: ``ok`` (``text`` is the
    result), ``raised`` (``text``: the exception, ``"Type: message"``), ``invalid`` (``text``: why the value has no
    text form), ``timeout``/``crash`` (``text`` ends the sentence "the tool NAME ...", e.g. "timed out after 10 s").
    Runs on: the rollout's process (and its tool threads)."""
    if kind == "raised":
        text = f"error: the tool {name} raised {text}"
    elif kind == "invalid":
        kind, text = "invalid_result", f"error: the tool {name} returned a value the model cannot read: {text}"
    elif kind != "ok":
        text = f"error: the tool {name} {text}"
    return ToolResult(text, kind, seconds)


@dataclass
class _Process:
    """One start of the coroutine worker: its process, connection, reader thread and calls in flight (number ->
    future, tool name, time sent)."""

    proc: Popen[bytes]
    conn: Connection
    calls: dict[int, tuple[Future[ToolResult], str, float]]
    reader: threading.Thread | None = None
    closing_at: float | None = None  # when the executor asked it to end


class _CoroutineWorker:
    """The worker process of an executor's ``async def`` tools: every call is sent at once and runs as a task of its
    event loop; one reader thread per process takes the answers, and kills the process when a call outlives its
    timeout by :data:`_COROUTINE_GRACE_S` (the loop is blocked) or when the process dies (its calls then fail)."""

    def __init__(self, payload: bytes, *, names: set[str], timeout_s: float, max_chars: int) -> None:
        self._payload = payload
        self.names = names
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self._lock = threading.RLock()
        self._numbers = itertools.count()
        self._live: _Process | None = None
        self.started = 0

    def process(self) -> _Process:
        """The live process, started (with its reader) when there is none."""
        with self._lock:
            if self._live is None:
                self._live = _Process(*spawn_worker(self._payload), calls={})
                self.started += 1
                self._live.reader = threading.Thread(
                    target=self._read, args=(self._live,), name="lightning-rlhf-tool-answers", daemon=True
                )
                self._live.reader.start()
            return self._live

    def submit(self, name: str, arguments: dict[str, Any]) -> Future[ToolResult]:
        """Send one call to the live process (started if there is none); its reader sets the future. Runs on: the
        rollout's process, any thread."""
        future: Future[ToolResult] = Future()
        future.set_running_or_notify_cancel()
        with self._lock:
            live = self.process()
            number = next(self._numbers)
            live.calls[number] = (future, name, time.monotonic())
            with contextlib.suppress(OSError):  # it died: its reader fails the call
                live.conn.send_bytes(pickle.dumps((number, name, arguments, self.max_chars, self.timeout_s)))
        return future

    def close(self) -> None:
        """Ask the live process to end and wait for its reader (which kills a blocked one). Runs on: the rollout's
        process."""
        with self._lock:
            live, self._live = self._live, None
        if live is not None:
            live.closing_at = time.monotonic()
            with contextlib.suppress(OSError):
                live.conn.send_bytes(pickle.dumps(None))  # the worker's loop ends; its reader then sees the end
            assert live.reader is not None
            live.reader.join()  # within about a second: a worker whose loop is blocked is killed

    def _read(self, live: _Process) -> None:
        """The answers of one process, until it ends; then its calls left fail (a reader thread)."""
        why, ready_at, born = "crash", None, time.monotonic()
        with contextlib.suppress(EOFError, OSError):
            while True:
                now = time.monotonic()
                if live.closing_at is not None and now > live.closing_at + 1.0:
                    break  # asked to end a second ago and still there: its loop is blocked (killed below)
                if ready_at is None:
                    wait_s = born + STARTUP_TIMEOUT_S - now
                    if wait_s <= 0:
                        why = f"could not run (its worker did not start within {STARTUP_TIMEOUT_S:g} s)"
                        break
                else:
                    with self._lock:
                        first = min((max(t, ready_at) for _, _, t in live.calls.values()), default=math.inf)
                    wait_s = min(1.0, first + self.timeout_s + _COROUTINE_GRACE_S - now)
                    if wait_s <= 0:
                        why = "blocked"
                        break
                if not live.conn.poll(min(wait_s, 1.0) if live.closing_at is None else 0.05):
                    continue
                message = pickle.loads(live.conn.recv_bytes())
                if message[0] == "ready":
                    ready_at = time.monotonic()
                elif message[0] == "load_error":
                    why = f"could not run (the tools did not load in their worker: {message[1]})"
                    break
                else:
                    number, kind, text = message
                    with self._lock:
                        future, name, sent = live.calls.pop(number)
                    future.set_result(tool_result(name, kind, text, time.monotonic() - max(sent, ready_at or sent)))
        with self._lock:
            if self._live is live:
                self._live = None
            failed = list(live.calls.values())
            live.calls.clear()
        how = kill_worker(live.proc, term=why == "blocked" or live.closing_at is not None)
        live.conn.close()
        now = time.monotonic()
        for future, name, sent in failed:
            kind, text = "crash", why
            if live.closing_at is not None:
                text = "was stopped: its executor closed"
            elif why == "blocked" and now - max(sent, ready_at or now) >= self.timeout_s:
                kind, text = "timeout", f"timed out after {self.timeout_s:g} s"
            elif why == "blocked":
                text = "was stopped: a call blocked the tools' event loop past its timeout"
            elif why == "crash":
                text = f"crashed (its process ended: {how})"
            future.set_result(tool_result(name, kind, text, now - sent))


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

        coroutines = {name: fn for name, fn in functions.items() if inspect.iscoroutinefunction(fn)}
        plain = {name: fn for name, fn in functions.items() if name not in coroutines}
        try:
            fn_bytes = cloudpickle.dumps(plain)
            coroutine_bytes = cloudpickle.dumps(coroutines) if coroutines else b""
        except Exception as err:
            raise TypeError(
                f"the tools {sorted(functions)} cannot be sent to their worker processes: cloudpickle failed with "
                f"{type(err).__name__}: {err}. HINT: create clients, locks and models inside the tool function (or "
                "in a module it imports) rather than capturing them."
            ) from err
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self._payload = worker_payload("tool", fn_bytes, next(iter(plain.values()), None))
        self._coroutines: _CoroutineWorker | None = None
        if coroutines:
            payload = worker_payload("async-tool", coroutine_bytes, next(iter(coroutines.values())))
            self._coroutines = _CoroutineWorker(
                payload, names=set(coroutines), timeout_s=timeout_s, max_chars=max_chars
            )
        self.num_workers = num_workers if plain else 0  # of the plain tools (the async def ones share one more)
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="lightning-rlhf-tool")
        self._local = threading.local()
        self._workers: list[Worker] = []
        self._lock = threading.Lock()
        self._started = 0
        self.closed = False
        _EXECUTORS.add(self)

    @property
    def started(self) -> int:
        """Worker processes started so far, replacements included. Runs on: the rollout's process."""
        return self._started + (self._coroutines.started if self._coroutines is not None else 0)

    def start(self) -> None:
        """Start the workers now (the first calls would otherwise wait for them). Runs on: the rollout's process."""
        for _ in range(self.num_workers):
            self._threads.submit(self._worker)
        if self._coroutines is not None:
            self._coroutines.process()

    def submit(self, call: ToolCallLike) -> Future[ToolResult]:
        """Run ``call`` (its arguments already checked) in a tool worker; the future never raises.
        Runs on: the rollout's process, any thread."""
        if self.closed:
            raise RuntimeError("the tool executor is closed. HINT: make a new one.")
        if self._coroutines is not None and call.name in self._coroutines.names:
            return self._coroutines.submit(call.name, call.arguments)
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
        if self._coroutines is not None:
            self._coroutines.close()

    def _worker(self) -> Worker:
        """This thread's worker, started (and waited for, up to the start-up bound) when it has none."""
        w: Worker | None = getattr(self._local, "worker", None)
        if w is None:
            w = Worker(*spawn_worker(self._payload))
            with self._lock:
                self._workers.append(w)
                self._started += 1
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

    def _drop(self, w: Worker) -> str:
        with self._lock:
            if w in self._workers:
                self._workers.remove(w)
        self._local.worker = None
        return w.close(term=True)

    def _run(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        start = time.monotonic()
        try:
            w = self._worker()
        except Exception as err:
            return tool_result(name, "crash", f"could not run ({err})", time.monotonic() - start)
        start = time.monotonic()  # the timeout counts from the moment a started worker takes the call
        try:
            w.conn.send_bytes(pickle.dumps((name, arguments, self.max_chars)))
            if not w.conn.poll(self.timeout_s):
                self._drop(w)
                kind, text = "timeout", f"timed out after {self.timeout_s:g} s"
            else:
                kind, _, text, _ = pickle.loads(w.conn.recv_bytes())
        except (EOFError, OSError):
            kind, text = "crash", f"crashed (its process ended: {self._drop(w)})"
        return tool_result(name, kind, text, time.monotonic() - start)


_EXECUTORS: weakref.WeakSet[ToolExecutor] = weakref.WeakSet()


@atexit.register
def _close_executors() -> None:
    for executor in list(_EXECUTORS):
        with contextlib.suppress(Exception):
            executor.close()
