"""Long-lived reward worker processes: a pool per reward function, each worker a freshly spawned interpreter
(never a fork of the trainer) that gets the function once, with ``cloudpickle``, and serves calls until it is closed.
Tool workers (:mod:`lightning_rlhf.agents.executor`) are the same program, serving tool calls.

This file is also the worker's main program: it imports only the standard library (and what the function needs),
so that a worker starts in a fraction of a second. Why spawn, cloudpickle and process groups: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import dataclasses
import inspect
import linecache
import logging
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = [
    "IN_PROCESS",
    "WORKER_ENV",
    "RewardPool",
    "ScoresError",
    "Worker",
    "as_scores",
    "awaited",
    "close_reward_pools",
    "raised_message",
    "reward_pool",
    "spawn_worker",
    "tool_answer",
    "tool_result_text",
    "worker_payload",
]

log = logging.getLogger(__name__)

IN_PROCESS = "__lightning_rlhf_in_process__"
"""An attribute that, set true on a reward function, has it called in the scoring process whatever
``RewardConfig.timeout_s`` says: for the framework's own functions that only read a column (the environment's
reward), which a worker process would only slow down."""

WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
"""Set in every worker's environment: one thread per native math library (num_workers processes run at once
beside the trainer; a reward function should not start an OpenMP pool per core)."""
STARTUP_TIMEOUT_S = 120.0
"""Seconds a new worker may take to start and load its function (imports included) before it counts as hung."""
_TERM_GRACE_S = 1.0  # SIGTERM first (the function's `finally` blocks run), SIGKILL after this long
_MAX_POOLS = 16  # pools kept by `reward_pool` (least recently used closed first): bounds a loop of fresh lambdas

Call = tuple[list[str], list[str], dict[str, list[Any]]]
"""One call's ``(prompts, completions, columns)``."""
Result = tuple[str, list[float] | None, str, str]
"""``(kind, scores, message, traceback)``; kind: ok, raised, invalid, timeout, crash."""


class ScoresError(ValueError):
    """A reward function's return value is not one finite real number per completion."""


# ------------------------------------------------------------------------------------- return values
def as_scores(values: Any, *, name: str, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
    """``values`` as one finite float per completion, or a :class:`ScoresError` saying what is wrong. Runs on:
    wherever the reward function ran (the worker holding the samples, or a reward worker process).

    Accepted: any 1-D sequence of real numbers (lists, tuples, numpy arrays, torch tensors), whose elements may
    be Python, numpy or 0-d tensor scalars. Refused: strings, mappings, sets, generators, arrays of another
    dimension, a wrong length, strings or other non-numbers as elements, NaN and infinities."""
    n = len(prompts)
    kind = type(values).__name__
    ndim = getattr(values, "ndim", None)
    if isinstance(ndim, int) and callable(getattr(values, "tolist", None)):  # numpy array, torch tensor
        if ndim != 1:
            shape = tuple(getattr(values, "shape", ()))
            raise ScoresError(
                f"reward function `{name}` returned a {ndim}-D {kind} of shape {shape}; expected a 1-D sequence of "
                f"{n} floats, one per completion. HINT: return `scores.reshape(-1)` if it holds one score per "
                "completion."
            )
        values = values.tolist()
    elif not isinstance(values, Sequence) or isinstance(values, str | bytes | bytearray):
        raise ScoresError(
            f"reward function `{name}` returned {kind}; expected a list of {n} floats, one per completion."
        )
    if len(values) != n:
        raise ScoresError(
            f"reward function `{name}` returned {len(values)} values for {n} completions; "
            "expected exactly one float per completion."
        )
    out = []
    for i, v in enumerate(values):
        f = math.nan
        if not isinstance(v, str | bytes) and hasattr(type(v), "__float__") and getattr(v, "ndim", 0) == 0:
            with contextlib.suppress(TypeError, ValueError, OverflowError):
                f = float(v)
        if not math.isfinite(f):
            raise ScoresError(
                f"reward function `{name}` returned {v!r} for completion {i} "
                f"(prompt {prompts[i]!r}, completion {completions[i]!r}); expected a finite float. "
                "HINT: return 0.0 (or another fallback) for completions you cannot score."
            )
        out.append(f)
    return out


# ----------------------------------------------------------------------------------------- the pool
@dataclasses.dataclass(eq=False)
class Worker:
    """One worker process (a reward pool's, or a tool executor thread's) and the connection to it."""

    proc: subprocess.Popen[bytes]
    conn: Connection
    started: float = dataclasses.field(default_factory=time.monotonic)
    ready: bool = False
    call: int | None = None  # index of the call it runs (a reward pool's)
    deadline: float = math.inf

    def close(self, *, term: bool) -> str:
        """Kill its process group (SIGTERM first if ``term``), reap it; returns how it ended. Runs on: its owner."""
        self.conn.close()
        return kill_worker(self.proc, term=term)


class RewardPool:
    """Worker processes for one reward function ``fn`` (pickled once, when the pool is made), reused across calls
    and steps; ``name``: how the function is named in messages.

    Runs on: the process that scores (a worker rank of the trainer); its workers are child processes. Not
    shared across processes: a pool used in a process it was not made in (after a fork) raises.

    Raises:
        TypeError: ``fn`` cannot be pickled (it holds a lock, a socket, a CUDA tensor, ...).
    """

    def __init__(self, fn: Callable[..., Any], *, name: str) -> None:
        import cloudpickle

        try:
            fn_bytes = cloudpickle.dumps(fn)
        except Exception as err:
            raise TypeError(
                f"reward function `{name}` cannot be sent to its reward worker process: cloudpickle failed with "
                f"{type(err).__name__}: {err}. HINT: create locks, sockets, clients and models inside the "
                "function (or in a module it imports) rather than capturing them, or set "
                "RewardConfig(timeout_s=None) to call it in the trainer process (no timeout, no isolation)."
            ) from err
        self.name = name
        self.fn = fn  # held so that the registry's key (the function's id) stays unique
        self._payload = worker_payload("reward", fn_bytes, fn)
        self._workers: list[Worker] = []
        self._size = 0  # workers kept started between calls (the largest num_workers asked for)
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._call_name = name
        self.closed = False
        self.started = 0  # worker processes started so far (replacements included)

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers (started or starting)."""
        return [w.proc.pid for w in self._workers]

    def start(self, num_workers: int = 1) -> None:
        """Start workers up to ``num_workers`` without waiting for them (the next call waits, if it must). Runs on:
        the scoring process, e.g. when its role loads, so that the start overlaps model loading."""
        with self._lock:
            self._check_usable(num_workers)
            self._top_up(self._size)

    def run(
        self, calls: Sequence[Call], *, timeout_s: float, num_workers: int, name: str | None = None
    ) -> list[Result]:
        """Run ``calls`` on up to ``num_workers`` workers at once (the pool keeps this many from now on), each call
        for at most ``timeout_s`` seconds from the moment a started worker takes it; returns one :data:`Result` per
        call, in order. ``name``: how the function is named in messages (default: the pool's name). Runs on: the
        scoring process. A call that times out, or whose worker dies, kills that worker and its process group; a
        new worker (its start bounded by :data:`STARTUP_TIMEOUT_S`) replaces it."""
        with self._lock:
            self._check_usable(num_workers)
            self._call_name = name or self.name
            return self._run(list(calls), timeout_s=timeout_s, num_workers=max(1, num_workers))

    def close(self) -> None:
        """End every worker (and anything its function left running). Idempotent. Runs on: the scoring process, at
        teardown and at interpreter exit."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if os.getpid() != self._owner:  # a forked copy: the workers belong to the parent
                return
            workers, self._workers = self._workers, []
            for w in workers:
                w.conn.close()  # end of input: an idle worker exits by itself
            deadline = time.monotonic() + _TERM_GRACE_S
            for w in workers:
                _wait_exit(w.proc.pid, deadline - time.monotonic())
                _reap(w.proc)

    def _check_usable(self, num_workers: int) -> None:
        """Raise for a closed pool or one used after a fork; else keep ``num_workers`` workers from now on."""
        if self.closed:
            raise RuntimeError(f"the reward pool of `{self.name}` is closed. HINT: get a new one with reward_pool().")
        if os.getpid() != self._owner:
            raise RuntimeError(
                f"the reward pool of `{self.name}` was made in process {self._owner} and used in {os.getpid()} "
                "(a fork). HINT: make pools in the process that scores (reward_pool() does)."
            )
        self._size = max(self._size, num_workers)

    def _top_up(self, size: int) -> None:
        while len(self._workers) < size:
            self._workers.append(Worker(*spawn_worker(self._payload)))
            self.started += 1

    def _remove(self, w: Worker, *, term: bool) -> str:
        self._workers.remove(w)
        return w.close(term=term)

    def _run(self, calls: list[Call], *, timeout_s: float, num_workers: int) -> list[Result]:
        results: list[Result | None] = [None] * len(calls)
        pending = collections.deque(range(len(calls)))
        for w in [w for w in self._workers if w.call is None and _wait_exit(w.proc.pid, 0.0)]:
            self._remove(w, term=False)  # died while idle (killed from outside): replace without a word
        try:
            while pending or any(w.call is not None for w in self._workers):
                busy = sum(w.call is not None for w in self._workers)
                self._top_up(min(num_workers, busy + len(pending)))
                for w in self._workers:
                    if pending and w.ready and w.call is None:
                        i = pending.popleft()
                        prompts, completions, columns = calls[i]
                        try:
                            w.conn.send_bytes(pickle.dumps((self._call_name, prompts, completions, columns)))
                        except OSError:
                            pending.appendleft(i)  # died since it said ready: its EOF is read below
                            continue
                        w.call, w.deadline = i, time.monotonic() + timeout_s
                deadlines = [w.deadline for w in self._workers if w.call is not None]
                deadlines += [w.started + STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
                watched = {w.conn: w for w in self._workers if w.call is not None or not w.ready}
                delay = max(0.0, min(deadlines, default=math.inf) - time.monotonic())
                for conn in wait(list(watched), timeout=None if delay == math.inf else delay):
                    self._receive(watched[conn], calls, results, pending)  # type: ignore[index]
                now = time.monotonic()
                for w in list(self._workers):
                    if w.call is not None and now >= w.deadline:
                        self._remove(w, term=True)
                        n = len(calls[w.call][0])
                        message = f"reward function `{self._call_name}` timed out after {timeout_s:g} s on {n} samples"
                        results[w.call] = ("timeout", None, message, "")
                    elif not w.ready and now >= w.started + STARTUP_TIMEOUT_S:
                        self._remove(w, term=True)
                        message = (
                            f"the reward process of `{self._call_name}` did not load the function within "
                            f"{STARTUP_TIMEOUT_S:g} s (a slow or hanging import?)"
                        )
                        _fail_pending(pending, results, ("timeout", None, message, ""))
        except BaseException:  # an error (or KeyboardInterrupt) while calls run: leave no call running
            for w in [w for w in self._workers if w.call is not None]:
                self._remove(w, term=True)
            raise
        finally:
            with contextlib.suppress(Exception):
                self._top_up(self._size)  # replacements start now, ready by the next call
        return [r if r is not None else ("crash", None, "lost", "") for r in results]

    def _receive(self, w: Worker, calls: list[Call], results: list[Result | None], pending: Any) -> None:
        """Handle one message (or the end of input) from ``w``."""
        try:
            msg = pickle.loads(w.conn.recv_bytes())
        except (EOFError, OSError):
            how = self._remove(w, term=False)
            if w.call is not None:
                n = len(calls[w.call][0])
                message = f"reward function `{self._call_name}` crashed on {n} samples: its process died ({how})"
                results[w.call] = ("crash", None, message, "")
            elif not w.ready:
                message = f"the reward process of `{self._call_name}` died ({how}) while loading the function"
                _fail_pending(pending, results, ("crash", None, message, ""))
            return
        if msg[0] == "ready":
            w.ready = True
        elif msg[0] == "load_error":
            self._remove(w, term=True)
            message = (
                f"reward function `{self._call_name}` could not be loaded in its reward process: {msg[1]}. HINT: the "
                "worker imports the function's module by name with the trainer's sys.path; define the function in "
                "an importable module (or in the script), and check that its module imports without error."
                f"\n--- traceback (in the reward process) ---\n{msg[2]}"
            )
            _fail_pending(pending, results, ("raised", None, message, msg[2]))
        else:
            assert w.call is not None
            results[w.call] = msg
            w.call, w.deadline = None, math.inf


def worker_payload(kind: str, fn_bytes: bytes, fn: Any) -> bytes:
    """What a new worker reads first: what it serves (``"reward"``: a reward function; ``"tool"``: a mapping of
    tool names to functions), the trainer's ``sys.path``, the cloudpickled object and, for tracebacks, the lines of
    the file that defines ``fn``. Runs on: the process that starts workers."""
    return pickle.dumps((kind, list(sys.path), fn_bytes, _source_lines(fn)))


def spawn_worker(payload: bytes) -> tuple[subprocess.Popen[bytes], Connection]:
    """Start one worker process (a new interpreter running this file, never a fork), send it ``payload``
    (:func:`worker_payload`); returns the process and its connection. The worker says ``("ready",)`` once loaded.
    Runs on: the process that owns the worker (safe from any thread: ``subprocess`` forks and execs at once)."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        env = {**os.environ, **WORKER_ENV}
        proc = subprocess.Popen(
            [sys.executable, "-P", os.path.abspath(__file__), str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            env=env,
            process_group=0,  # its own group: a kill reaches what the function started; Ctrl-C does not
        )
        conn = Connection(os.dup(ours.fileno()))
    with contextlib.suppress(OSError):  # it died at once: seen as a crash at its first read
        conn.send_bytes(payload)  # into the socket buffer; the worker reads it once it runs
    return proc, conn


def kill_worker(proc: subprocess.Popen[bytes], *, term: bool) -> str:
    """End a worker and what it started (its process group; SIGTERM first if ``term``), reap it; returns how it
    ended. Runs on: the process that owns the worker."""
    if term:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGTERM)
    _wait_exit(proc.pid, _TERM_GRACE_S)
    return _reap(proc)


def _fail_pending(pending: Any, results: list[Result | None], result: Result) -> None:
    while pending:
        results[pending.popleft()] = result


def _wait_exit(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for ``pid`` to exit, without reaping it (its group id stays reserved); whether
    it has exited."""
    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)


def _reap(proc: subprocess.Popen[bytes]) -> str:
    """SIGKILL what is left of ``proc``'s process group (its function's subprocesses too), reap ``proc``."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)  # the worker's own group, never ours
    code = proc.wait()
    return f"exit code {code}" if code >= 0 else signal.Signals(-code).name


# ------------------------------------------------------------------------------------- the registry
_POOLS: collections.OrderedDict[Any, RewardPool] = collections.OrderedDict()
_POOLS_LOCK = threading.Lock()


def _key(fn: Callable[..., Any]) -> Any:
    func, owner = getattr(fn, "__func__", None), getattr(fn, "__self__", None)
    if func is not None and owner is not None:  # a bound method: a new object at each attribute access
        return (id(owner), id(func))
    return id(fn)


def reward_pool(fn: Callable[..., Any], *, name: str) -> RewardPool:
    """The pool of ``fn`` in this process: made (without workers) on first use, then reused. Runs on: the scoring
    process. Keyed by the function object (a bound method by its object and function); at most 16 pools are kept,
    the least recently used is closed first."""
    with _POOLS_LOCK:
        key = _key(fn)
        pool = _POOLS.get(key)
        if pool is None or pool.closed:
            pool = _POOLS[key] = RewardPool(fn, name=name)
        _POOLS.move_to_end(key)
        evicted = [_POOLS.popitem(last=False)[1] for _ in range(len(_POOLS) - _MAX_POOLS)]
    for old in evicted:
        old.close()
    return pool


def close_reward_pools(fns: Sequence[Callable[..., Any]] | None = None) -> None:
    """Close the pools of ``fns`` (None: every pool of this process). Idempotent. Runs on: the scoring process, at
    teardown; also at interpreter exit."""
    with _POOLS_LOCK:
        keys = list(_POOLS) if fns is None else [_key(fn) for fn in fns]
        pools = [_POOLS.pop(k) for k in keys if k in _POOLS]
    for pool in pools:
        pool.close()


def _forget_pools_after_fork() -> None:
    """In a forked child: drop the parent's pools (their workers are the parent's), closing our copies of the
    sockets so that the workers still see the end of input when the parent dies."""
    for pool in _POOLS.values():
        pool.closed = True
        for w in pool._workers:
            with contextlib.suppress(OSError):
                w.conn.close()
    _POOLS.clear()


if __name__ != "__main__":
    atexit.register(close_reward_pools)
    os.register_at_fork(after_in_child=_forget_pools_after_fork)


DYNAMIC_CODE = "<dynamic-code>"
"""The file name cloudpickle (3.1.3 and later) gives the code of a function it pickles by value (a closure, a lambda,
a function of ``__main__`` or of a test module): the worker's traceback can then not read the source lines."""


def _source_lines(fn: Callable[..., Any]) -> list[str]:
    """The lines of the file that defines ``fn`` (a worker serves one function), for the worker's tracebacks."""
    code = getattr(fn, "__code__", None) or getattr(type(fn).__call__, "__code__", None)
    filename = getattr(code, "co_filename", "")
    return linecache.getlines(filename) if filename and not filename.startswith("<") else []


# ----------------------------------------------------------------------------------- the worker side
def _worker_main(fd: int, parent: int) -> None:
    """Main program of a worker: load the function (or tools), then serve calls until the end of input. Runs on: a
    worker process (spawned by :func:`spawn_worker`)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())  # a mask inherited from the spawning thread
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)  # killed means killed, whatever the trainer ignores or handles
    _die_with_parent(parent)
    os.set_inheritable(fd, False)  # the function's own subprocesses do not hold the pool's socket open
    conn = Connection(fd)
    with contextlib.suppress(EOFError, OSError):  # the pool closed (or the trainer died): exit quietly
        kind, sys_path, fn_bytes, source = pickle.loads(conn.recv_bytes())
        sys.path[:] = sys_path
        if source:  # tracebacks of a function pickled by value quote their lines (cloudpickle names its file so)
            linecache.cache[DYNAMIC_CODE] = (sum(map(len, source)), None, source, DYNAMIC_CODE)
        try:
            fn = pickle.loads(fn_bytes)
        except Exception as err:
            conn.send_bytes(pickle.dumps(("load_error", f"{type(err).__name__}: {err}", traceback.format_exc())))
            return
        conn.send_bytes(pickle.dumps(("ready",)))
        if kind == "async-tool":
            asyncio.run(_serve_coroutines(conn, fn))
            return
        while True:
            request = pickle.loads(conn.recv_bytes())
            result = _call(fn, *request) if kind == "reward" else _call_tool(fn, *request)
            with contextlib.suppress(Exception):  # before sending: the pool may kill this process once it has it
                sys.stdout.flush()
                sys.stderr.flush()
            conn.send_bytes(pickle.dumps(result))


def _call(
    fn: Callable[..., Any], name: str, prompts: list[str], completions: list[str], columns: Mapping[str, Any]
) -> Result:
    try:
        values = awaited(fn(prompts, completions, **columns))
    except Exception as err:
        tb = traceback.format_exc()
        message = raised_message(name, err, prompts, columns)
        return ("raised", None, f"{message}\n--- traceback of `{name}` (in its reward process) ---\n{tb}", tb)
    try:
        return ("ok", as_scores(values, name=name, prompts=prompts, completions=completions), "", "")
    except ScoresError as err:
        return ("invalid", None, str(err), "")
    except Exception as err:  # a sequence-like object whose len() or tolist() fails
        message = f"reward function `{name}` returned a {type(values).__name__} that cannot be read: {err!r}"
        return ("invalid", None, message, traceback.format_exc())


def raised_message(name: str, err: BaseException, prompts: list[str], columns: Mapping[str, Any]) -> str:
    """What a reward function's exception is reported as. Runs on: wherever the function ran."""
    return (
        f"reward function `{name}` raised {type(err).__name__}: {err} "
        f"(called on {len(prompts)} completions; dataset columns passed: {sorted(columns)})"
    )


def tool_result_text(value: Any, *, max_chars: int) -> str:
    """A tool's return value as the text of a ``tool`` message: a string as it is, JSON for numbers, booleans,
    None, lists and dicts, cut to ``max_chars`` characters. Runs on: the tool worker (or the rollout's process for
    an environment's in-process tools).

    Raises TypeError for anything else (an object with no text form the model could read).
    """
    import json

    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"it returned a {type(value).__name__}, which cannot be written into a message ({err}); a tool "
                "returns a string, a number, a boolean, None, or a list/dict of those"
            ) from err
    if len(text) > max_chars:
        text = text[:max_chars] + f"... [{len(text) - max_chars} characters cut]"
    return text


def tool_answer(value: Any, *, max_chars: int) -> tuple[str, str]:
    """``("ok", text)`` for a tool's return value (:func:`tool_result_text`), or ``("invalid", why it has no text
    form)``. Runs on: wherever the tool ran."""
    try:
        return "ok", tool_result_text(value, max_chars=max_chars)
    except TypeError as err:
        return "invalid", str(err)


def _call_tool(
    functions: Mapping[str, Callable[..., Any]], name: str, arguments: dict[str, Any], max_chars: int
) -> Result:
    """One tool call in a tool worker: ``("ok", text)``, or ``raised`` (the tool raised; the message is what the
    model sees) or ``invalid`` (its value has no text form)."""
    try:
        value = functions[name](**arguments)
    except Exception as err:
        return ("raised", None, f"{type(err).__name__}: {err}", traceback.format_exc())
    kind, text = tool_answer(value, max_chars=max_chars)
    return (kind, [] if kind == "ok" else None, text, "")


async def _serve_coroutines(conn: Connection, functions: Mapping[str, Callable[..., Any]]) -> None:
    """Main loop of a worker serving ``async def`` tools: each call, ``(number, name, arguments, max_chars,
    timeout_s)``, runs at once as a task of this event loop (cancelled past ``timeout_s``); its answer, ``(number,
    kind, text)``, goes back as soon as it ends. Runs on: an asynchronous tool worker (one thread reads requests)."""
    loop = asyncio.get_running_loop()
    requests: asyncio.Queue[Any] = asyncio.Queue()

    def read() -> None:  # a thread: Connection.recv_bytes blocks until a whole message is in
        message = None
        with contextlib.suppress(EOFError, OSError, RuntimeError):  # RuntimeError: the loop has ended already
            while (message := pickle.loads(conn.recv_bytes())) is not None:
                loop.call_soon_threadsafe(requests.put_nowait, message)
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(requests.put_nowait, None)  # None, or the end of input: the loop ends

    async def one(number: int, name: str, arguments: dict[str, Any], max_chars: int, timeout_s: float) -> None:
        try:
            value = await asyncio.wait_for(functions[name](**arguments), timeout_s)
        except TimeoutError:
            answer = ("timeout", f"timed out after {timeout_s:g} s")
        except (Exception, asyncio.CancelledError) as err:  # a tool may cancel what it awaits, and itself with it
            answer = ("raised", f"{type(err).__name__}: {err}")
        else:
            answer = tool_answer(value, max_chars=max_chars)
        with contextlib.suppress(OSError):
            conn.send_bytes(pickle.dumps((number, *answer)))

    threading.Thread(target=read, name="lightning-rlhf-tool-reader", daemon=True).start()
    tasks: set[asyncio.Task[None]] = set()
    while (request := await requests.get()) is not None:
        task = asyncio.create_task(one(*request))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


def awaited(value: Any) -> Any:
    """``value``, or what it gives once awaited when it is awaitable (an ``async def`` reward function's or
    environment's result), run to its end in an event loop of its own. Runs on: whichever process called the function
    (a worker, or the rollout's process when the call runs there)."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    return asyncio.run(wait())


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this process when the trainer (the thread that started it) ends."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the trainer died before prctl took effect
        os._exit(1)


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]), int(sys.argv[2]))
