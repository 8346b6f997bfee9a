"""Process launchers: Lightning's, minus the observer that SIGKILLs rank 0 when a child dies, plus the resume
path check before anything starts.

Lightning's ``_SubprocessScriptLauncher`` runs a thread that, within 5 s of a child rank exiting non-zero,
SIGKILLs every process including rank 0, so nothing could name the dead rank. Here that thread defers to the
strategy's watchdog (which names the rank and the role call, then ends the run) while the watchdog is running,
and stands aside during a preemption exit; outside those times it does what Lightning's does.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_rlhf.strategy.checkpoint_io import check_resume_path
from lightning_rlhf.strategy.liveness import exit_expected

__all__ = ["ExternalLauncher", "RLHFLauncher", "check_ckpt_argument", "watchdog_running"]

_WATCHDOG_RUNNING: list[bool] = [False]


def watchdog_running(value: bool) -> None:
    """Tell the child observer whether the strategy's watchdog handles dead ranks now. Runs on: rank 0."""
    _WATCHDOG_RUNNING[0] = value


def check_ckpt_argument(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Check the ``ckpt_path`` that ``trainer.fit``/``validate`` passed on, before any process or model starts.

    Runs on: the launching process (rank 0, or every rank when processes are created externally).
    """
    try:
        bound = inspect.signature(function).bind_partial(*args, **kwargs)
    except TypeError:
        return
    check_resume_path(bound.arguments.get("ckpt_path"))


class _DeferringObserver(_ChildProcessObserver):
    @override
    def _run(self) -> bool:
        if _WATCHDOG_RUNNING[0] or exit_expected():
            for proc in self._child_processes:
                proc.poll()
            return all(proc.returncode is not None for proc in self._child_processes)
        return super()._run()


class RLHFLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher with a child observer that defers to the strategy's watchdog.

    Runs on: rank 0 (it starts ranks 1.. as its children).
    """

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        check_ckpt_argument(function, args, kwargs)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            _DeferringObserver(child_processes=self.procs, main_pid=os.getpid()).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


class ExternalLauncher(_Launcher):
    """For processes started outside Lightning (torchrun, SLURM): starts nothing, checks the resume path.

    Runs on: every rank.
    """

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        check_ckpt_argument(function, args, kwargs)
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        """Nothing to kill: the processes were not started here."""
