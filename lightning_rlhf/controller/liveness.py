"""Which ranks are alive, and the watchdog thread that ends a process that can no longer make progress.

Every rank publishes its pid and machine (:func:`machine_id`) in the rendezvous store; the watchdog polls twice a
second for an error another rank posted and for a dead rank (a child by ``Popen.poll``, a rank on this machine by
its pid, one elsewhere by its heartbeat). The main thread raises :class:`RankDiedError` when its collective fails;
if it stays blocked, the watchdog prints the error and exits after a grace period. docs/faults.md has the details.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Death", "Liveness", "RankDiedError", "Watchdog", "exit_expected", "expect_exit", "machine_id"]

ERROR_KEY = "lightning_rlhf/error"
DEAD_KEY = "lightning_rlhf/dead"
STOP_KEY = "lightning_rlhf/stop"
_RANK_KEY = "lightning_rlhf/rank/{}"
_BEAT_KEY = "lightning_rlhf/heartbeat/{}"

_EXPECTED_EXIT = threading.Event()


def expect_exit() -> None:
    """Mark this process as shutting down on purpose (a preemption): peers that exit now are not a fault. Runs on:
    any rank."""
    _EXPECTED_EXIT.set()


def exit_expected() -> bool:
    """Whether :func:`expect_exit` was called in this process. Runs on: any rank."""
    return _EXPECTED_EXIT.is_set()


@dataclasses.dataclass(frozen=True)
class Death:
    """How a rank died, as known to the rank that saw it: its rank, pid and host name, and the role call the
    observer had in flight (``where``), if any."""

    rank: int
    pid: int
    host: str
    signal: int | None = None  # the signal that killed it (from its parent's ``waitpid``), if known
    exit_code: int | None = None  # its exit status, if it exited and this is known
    how: str = "its process is gone; its exit status is known only to its parent process"  # when neither is known
    where: str | None = None

    def describe(self) -> str:
        """``rank 1 (pid 123) died with SIGKILL`` (or ``with exit code 3``, or ``died (<how>)``)."""
        head = f"rank {self.rank} (pid {self.pid})"
        if self.signal is not None:
            return f"{head} died with {_signal_name(self.signal)}"
        if self.exit_code is not None:
            return f"{head} died with exit code {self.exit_code}"
        return f"{head} died ({self.how})"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RankDiedError(RuntimeError):
    """Another rank's process died while this one needed it; raised instead of the backend's connection error.
    ``death``: what is known of the dead rank; ``where``: the role call this rank had in flight (or was waiting
    after)."""

    def __init__(self, death: Death, where: str | None) -> None:
        self.death = death
        self.rank = death.rank
        self.where = where or death.where or "the step (between role calls)"
        super().__init__(
            f"{death.describe()} during {self.where}. HINT: the process was killed from outside or crashed "
            "(an out-of-memory killer sends SIGKILL: check `dmesg` or the scheduler's log); the surviving ranks "
            "stop too. Resume from the last checkpoint with `trainer.fit(..., ckpt_path=...)`."
        )


def machine_id() -> str:
    """Identify where this process's pids mean something: ``host|boot id|pid namespace``. Two processes with the same
    value see the same pids; any other pair must not compare pids. Parts that cannot be read (not Linux) are left
    empty. Runs on: any process.
    """
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    namespace = ""
    with contextlib.suppress(OSError):
        namespace = os.readlink("/proc/self/ns/pid")
    return f"{socket.gethostname()}|{boot}|{namespace}"


def _is_alive_locally(pid: int) -> bool:
    """A process on this machine exists and is not a zombie (a zombie is dead, waiting to be reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


class Liveness:
    """Knows every rank's pid, host and machine (:func:`machine_id`) and tells whether one of them died (a rank on
    another machine: when its heartbeat has not moved for ``heartbeat_timeout_s``)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        *,
        children: list[subprocess.Popen[Any]] | None = None,
        heartbeat_timeout_s: float = 60.0,
    ) -> None:
        self._store = store
        self.rank = rank
        self.world_size = world_size
        self._children = {p.pid: p for p in children or []}
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self.host = socket.gethostname()
        self.machine = machine_id()
        self.peers: dict[int, tuple[int, str]] = {}
        self.machines: dict[int, str] = {}
        self._beats: dict[int, tuple[int, float]] = {}
        self._store_failures = 0
        self._lock = threading.Lock()
        self.death: Death | None = None
        self.where: Callable[[], str | None] = lambda: None

    def publish(self) -> None:
        """Publish this rank's pid, host and machine, then read every other rank's (blocks until all have published).
        Runs on: every rank, at set-up (after the process group exists)."""
        info = {"pid": os.getpid(), "host": self.host, "machine": self.machine}
        self._store.set(_RANK_KEY.format(self.rank), json.dumps(info))
        for r in range(self.world_size):
            info = json.loads(self._store.get(_RANK_KEY.format(r)))
            self.peers[r] = (int(info["pid"]), str(info["host"]))
            self.machines[r] = str(info["machine"])

    def is_child(self, r: int) -> bool:
        """Whether rank ``r`` is this process's child: it runs on this machine and its pid is one this process
        started (a pid alone could be another machine's process). Runs on: any rank."""
        return self.machines.get(r) == self.machine and self.peers[r][0] in self._children

    def beat(self) -> None:
        """Advance this rank's heartbeat counter in the store. Runs on: every rank (watchdog thread)."""
        self._store.add(_BEAT_KEY.format(self.rank), 1)

    def check(self) -> Death | None:
        """One look at every other rank; returns (and remembers) the first death found. Runs on: any rank (watchdog
        thread, or the main thread after a failed collective)."""
        with self._lock:
            if self.death is None:
                self.death = self._find_death()
            return self.death

    def wait_for_death(self, timeout_s: float) -> Death | None:
        """Look for a dead rank for up to ``timeout_s`` seconds. Runs on: any rank (main thread)."""
        deadline = time.monotonic() + timeout_s
        while True:
            death = self.check()
            if death is not None or time.monotonic() >= deadline:
                return death
            time.sleep(0.1)

    def _find_death(self) -> Death | None:
        posted = self._posted()
        if posted is not None:
            return posted
        for r, (pid, host) in self.peers.items():
            death = None if r == self.rank else self._death_of(r, pid, host)
            if death is not None:
                # Rank 0 and first-hand observers (its parent, or any rank on its machine, which saw its pid go)
                # tell the others: ranks on other machines would only notice its heartbeat stop, much later.
                if self.rank == 0 or self.machines.get(r) == self.machine:
                    with contextlib.suppress(Exception):
                        self._store.compare_set(DEAD_KEY, "", pickle.dumps(death))
                return death
        return None

    def _posted(self) -> Death | None:
        try:
            if not self._store.check([DEAD_KEY]):
                self._store_failures = 0
                return None
            death = pickle.loads(self._store.get(DEAD_KEY))
        except Exception:
            self._store_failures += 1
            return None
        return death if isinstance(death, Death) else None

    def _death_of(self, r: int, pid: int, host: str) -> Death | None:
        where = self.where()
        child = self._children.get(pid) if self.is_child(r) else None
        if child is not None:
            code = child.poll()
            if code is None or code == 0:  # 0: it finished its script, a rank that ended cleanly
                return None
            if code < 0:
                return Death(r, pid, host, signal=-code, where=where)
            return Death(r, pid, host, exit_code=code, where=where)
        if self.machines.get(r) == self.machine:
            return None if _is_alive_locally(pid) else Death(r, pid, host, where=where)
        if r == 0 and self._store_failures >= 4:  # the store lives in rank 0's process
            return Death(r, pid, host, how=f"the rendezvous store on {host} stopped answering", where=where)
        try:
            count = int(self._store.add(_BEAT_KEY.format(r), 0))
        except Exception:
            return None
        now = time.monotonic()
        last = self._beats.get(r)
        if last is None or last[0] != count:
            self._beats[r] = (count, now)
        elif now - last[1] > self._heartbeat_timeout_s:
            how = f"no heartbeat from {host} for {self._heartbeat_timeout_s:.0f}s"
            return Death(r, pid, host, how=how, where=where)
        return None

    def kill_children(self) -> None:
        """SIGKILL this process's children that still run, so none outlives a failed run. Runs on: rank 0."""
        for child in self._children.values():
            if child.poll() is None:
                with contextlib.suppress(OSError):
                    child.kill()


class Watchdog:
    """Ends this process if it cannot make progress: another rank posted an error, or died.

    After an error is posted, a rank blocked in a control-plane exchange (``busy``) is ended after ``timeout_s``
    (``RLHFStrategy(worker_error_timeout_s=...)``), any other rank after three times that. After a death, the main
    thread gets ``grace_s`` to raise :class:`RankDiedError` and exit on its own; then the watchdog prints the error
    and exits with 1. ``stop_flag``: the signal number of a stop this rank was asked for (0 if none), posted to the
    store so rank 0 sees it.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        timeout_s: float,
        *,
        liveness: Liveness,
        stop_flag: Callable[[], int],
        grace_s: float = 10.0,
        poll_s: float = 0.5,
    ) -> None:
        self._store = store
        self._rank = rank
        self._timeout_s = timeout_s
        self._liveness = liveness
        self._stop_flag = stop_flag
        self._stop_posted = False
        self._grace_s = grace_s
        self._poll_s = poll_s
        self._stop = threading.Event()
        self.busy = False
        self._thread = threading.Thread(target=self._run, name="lightning_rlhf-watchdog", daemon=True)
        self._thread.start()
        atexit.register(self.stop)  # leave no thread inside a store call while the interpreter shuts down

    def stop(self) -> None:
        """Stop the thread (it is a daemon either way). Runs on: any rank, at teardown and at exit."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self._poll_s + 1)

    def post_stop(self) -> None:
        """Post this rank's stop request (a preemption signal) once, for rank 0 to read. Runs on: any rank."""
        signum = self._stop_flag()
        if signum and not self._stop_posted:
            with contextlib.suppress(Exception):
                self._store.compare_set(STOP_KEY, "", str(signum))
                self._stop_posted = True

    def _run(self) -> None:
        error_seen_at: float | None = None
        death_seen_at: float | None = None
        while not self._stop.wait(self._poll_s):
            self.post_stop()
            if not exit_expected():
                with contextlib.suppress(Exception):
                    self._liveness.beat()
                death = self._liveness.check()
                if death is not None:
                    death_seen_at = death_seen_at or time.monotonic()
                    if time.monotonic() - death_seen_at >= self._grace_s and not exit_expected():
                        self._end(str(RankDiedError(death, self._liveness.where())), "a rank died")
                    continue
            try:
                posted = self._store.check([ERROR_KEY])
            except Exception:  # rank 0's store is gone: a death the liveness check names, or a posted error
                posted = error_seen_at is not None
            if not posted:
                continue
            error_seen_at = error_seen_at or time.monotonic()
            if time.monotonic() - error_seen_at < self._timeout_s * (1 if self.busy else 3):
                continue
            try:
                message, _ = pickle.loads(self._store.get(ERROR_KEY))
            except Exception:
                message = "another rank failed (its message could not be read)"
            self._end(message, f"blocked {self._timeout_s:.0f}s after an error elsewhere")

    def _end(self, message: str, why: str) -> None:
        print(
            f"\n[lightning_rlhf] rank {self._rank}: {why}; ending this process.\n{message}",
            file=sys.stderr,
            flush=True,
        )
        self._liveness.kill_children()
        os._exit(1)
