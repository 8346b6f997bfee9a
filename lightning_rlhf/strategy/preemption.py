"""Preemption signals (SIGTERM, SIGUSR1): stop at the next step boundary, save, exit with ``128 + signum``.

The handler only records the signal; the controller decides at the end of a step for every rank, so all stop
after the same step (docs/faults.md)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

__all__ = ["PreemptionHandler", "parse_signals", "stop_after_preemption"]


def parse_signals(signals: Sequence[int | str | signal.Signals]) -> tuple[signal.Signals, ...]:
    """``("SIGTERM", "USR1", 15)`` -> ``(Signals.SIGTERM, Signals.SIGUSR1, Signals.SIGTERM)`` (duplicates dropped).
    Runs on: any process. Raises ``ValueError`` naming the setting for a signal that does not exist or cannot be handled
    (SIGKILL, SIGSTOP)."""
    out: list[signal.Signals] = []
    for item in signals:
        try:
            if isinstance(item, str):
                name = item.upper()
                sig = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
            else:
                sig = signal.Signals(item)
        except (KeyError, ValueError):
            raise ValueError(
                f"RLHFStrategy(preemption_signals=...) holds {item!r}, which is not a signal on this platform. "
                "HINT: use names such as 'SIGTERM' or 'SIGUSR1'."
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(
                f"RLHFStrategy(preemption_signals=...) holds {sig.name}, which no process can handle. "
                "HINT: schedulers send SIGTERM (or SIGUSR1 with `--signal`) before SIGKILL; list those."
            )
        if sig not in out:
            out.append(sig)
    return tuple(out)


def stop_after_preemption(trainer: Any, signum: int, path: str | bool | None, *, rank: int) -> int:
    """Save the preemption checkpoint (``path``: ``RLHFStrategy(preemption_path=...)``, its default place for None;
    False: no checkpoint) and say so on rank 0; the exit status, ``128 + signum``. Runs on: every rank (the save is a
    collective), in ``RLHFStrategy.on_exception`` after the agreed stop."""
    name, code = signal.Signals(signum).name, 128 + signum
    if path is False:
        if rank == 0:
            print(
                f"[lightning_rlhf] stopped by {name} after step {trainer.global_step} without a checkpoint "
                f"(preemption_checkpoint=False); exiting with {code}.",
                flush=True,
            )
        return code
    if path is None or path is True:
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        root = os.path.join(trainer.log_dir or trainer.default_root_dir, "checkpoints")
        path = os.path.join(dirpath or root, "preempted.ckpt")
    trainer.save_checkpoint(path)
    if rank == 0:
        print(
            f"[lightning_rlhf] stopped by {name} after step {trainer.global_step}: checkpoint saved to {path}\n"
            f"[lightning_rlhf] resume with trainer.fit(..., ckpt_path={str(path)!r}); exiting with {code}.",
            flush=True,
        )
    return code


class PreemptionHandler:
    """Records the first of ``signals`` this process (rank ``rank``) receives.

    While not :attr:`active` (before set-up, after teardown) a signal gets its default action, so a process
    that is not training is still ended by SIGTERM."""

    def __init__(self, signals: Sequence[signal.Signals], rank: int = 0) -> None:
        self.signals = tuple(signals)
        self.rank = rank
        self.requested = 0  # the signal number received, 0 if none
        self.active = False
        self._previous: dict[signal.Signals, Any] = {}

    def install(self) -> None:
        """Handle the signals from now on (again, if Lightning replaced the handlers in between). Runs on: every rank,
        main thread (elsewhere Python cannot set handlers; then nothing happens)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            previous = signal.signal(sig, self._on_signal)
            if sig not in self._previous and previous is not self._on_signal:
                self._previous[sig] = previous
        self.active = True

    def restore(self) -> None:
        """Put back the handlers that were there before :meth:`install`. Runs on: every rank, at teardown."""
        self.active = False
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) is self._on_signal:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if not self.active:  # a late signal: do what the process would have done without us
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        name = signal.Signals(signum).name
        if self.requested:
            message = f"[lightning_rlhf] rank {self.rank}: received {name} again; still stopping at the step's end.\n"
        else:
            self.requested = signum
            message = (
                f"[lightning_rlhf] rank {self.rank}: received {name}; stopping after the current training step "
                f"(a checkpoint is saved if preemption_checkpoint=True), then exiting with {128 + signum}.\n"
            )
        os.write(2, message.encode())  # print() may re-enter a stream the main thread is writing
