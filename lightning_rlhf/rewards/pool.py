"""Long-lived reward worker processes: a pool per reward function, each worker a sandbox worker
(:mod:`lightning_rlhf.sandbox`: a freshly spawned interpreter, never a fork of the trainer) that gets the function
once, with ``cloudpickle``, and serves calls until it is closed. Why spawn, cloudpickle and process groups:
docs/architecture.md.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import math
import os
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from lightning_rlhf.sandbox.process import (
    STARTUP_TIMEOUT_S,
    TERM_GRACE_S,
    Worker,
    reap,
    spawn_worker,
    wait_exit,
    worker_payload,
)
from lightning_rlhf.sandbox.worker import Result

__all__ = ["RewardPool", "close_reward_pools", "reward_pool"]

_MAX_POOLS = 16  # pools kept by `reward_pool` (least recently used closed first): bounds a loop of fresh lambdas

Call = tuple[list[str], list[str], dict[str, list[Any]]]
"""One call's ``(prompts, completions, columns)``."""


# ----------------------------------------------------------------------------------------- the pool
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
            deadline = time.monotonic() + TERM_GRACE_S
            for w in workers:
                wait_exit(w.proc.pid, deadline - time.monotonic())
                reap(w.proc)

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
        for w in [w for w in self._workers if w.call is None and wait_exit(w.proc.pid, 0.0)]:
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


def _fail_pending(pending: Any, results: list[Result | None], result: Result) -> None:
    while pending:
        results[pending.popleft()] = result


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


atexit.register(close_reward_pools)
os.register_at_fork(after_in_child=_forget_pools_after_fork)
