"""The parent side of a sandbox worker: start one (a fresh interpreter running :mod:`lightning_rlhf.sandbox.worker`,
never a fork of the caller), hand it what it serves, and end it with everything it started (its process group).
Why spawn, cloudpickle and process groups: docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
import math
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

__all__ = [
    "IN_PROCESS",
    "STARTUP_TIMEOUT_S",
    "TERM_GRACE_S",
    "WORKER_ENV",
    "WORKER_PROGRAM",
    "Worker",
    "kill_worker",
    "reap",
    "spawn_worker",
    "wait_exit",
    "worker_payload",
]

IN_PROCESS = "__lightning_rlhf_in_process__"
"""An attribute that, set true on a reward function, has it called in the scoring process whatever
``RewardConfig.timeout_s`` says: for the framework's own functions that only read a column (the environment's
reward), which a worker process would only slow down."""

WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
"""Set in every worker's environment: one thread per native math library (num_workers processes run at once
beside the trainer; a reward function should not start an OpenMP pool per core)."""
STARTUP_TIMEOUT_S = 120.0
"""Seconds a new worker may take to start and load its function (imports included) before it counts as hung."""
TERM_GRACE_S = 1.0
"""Seconds a worker has to exit after SIGTERM (its function's ``finally`` blocks run) before it gets SIGKILL."""
WORKER_PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
"""The file a worker's interpreter runs as its main program (standard library only)."""


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


def worker_payload(kind: str, fn_bytes: bytes, fn: Any) -> bytes:
    """What a new worker reads first: what it serves (``"reward"``: a reward function; ``"tool"``: a mapping of
    tool names to functions; ``"async-tool"``: one of ``async def`` tools), the caller's ``sys.path``, the
    cloudpickled object and, for tracebacks, the lines of the file that defines ``fn``. Runs on: the process that
    starts workers."""
    return pickle.dumps((kind, list(sys.path), fn_bytes, _source_lines(fn)))


def _source_lines(fn: Any) -> list[str]:
    """The lines of the file that defines ``fn`` (a worker serves one function), for the worker's tracebacks."""
    code = getattr(fn, "__code__", None) or getattr(type(fn).__call__, "__code__", None)
    filename = getattr(code, "co_filename", "")
    return linecache.getlines(filename) if filename and not filename.startswith("<") else []


def spawn_worker(payload: bytes) -> tuple[subprocess.Popen[bytes], Connection]:
    """Start one worker process (a new interpreter running :data:`WORKER_PROGRAM`, never a fork), send it ``payload``
    (:func:`worker_payload`); returns the process and its connection. The worker says ``("ready",)`` once loaded.
    Runs on: the process that owns the worker (safe from any thread: ``subprocess`` forks and execs at once)."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        env = {**os.environ, **WORKER_ENV}
        proc = subprocess.Popen(
            [sys.executable, "-P", WORKER_PROGRAM, str(theirs.fileno()), str(os.getpid())],
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
    wait_exit(proc.pid, TERM_GRACE_S)
    return reap(proc)


def wait_exit(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for the worker ``pid`` to exit, without reaping it (its group id stays reserved);
    whether it has exited. Runs on: the process that owns the worker."""
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


def reap(proc: subprocess.Popen[bytes]) -> str:
    """SIGKILL what is left of the worker ``proc``'s process group (its function's subprocesses too), reap ``proc``;
    returns how it ended (``"exit code N"`` or the signal's name). Runs on: the process that owns the worker."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)  # the worker's own group, never ours
    code = proc.wait()
    return f"exit code {code}" if code >= 0 else signal.Signals(-code).name
