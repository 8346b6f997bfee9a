"""Process launchers: Lightning's, minus the observer that SIGKILLs rank 0 when a child dies, plus the resume
path check before anything starts.

Lightning's ``_SubprocessScriptLauncher`` runs a thread that, within 5 s of a child rank exiting non-zero,
SIGKILLs every process including rank 0, so nothing could name the dead rank. Here that thread defers to the
strategy's watchdog (which names the rank and the role call, then ends the run) while the watchdog is running,
and stands aside during a preemption exit; outside those times it does what Lightning's does. The Lightning
internals involved live in :mod:`lightning_rlhf.compat.lightning`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_rlhf.compat.lightning import Launcher, SubprocessScriptLauncher, start_subprocess_ranks
from lightning_rlhf.controller.liveness import exit_expected
from lightning_rlhf.strategy.checkpoint_io import check_resume_lora, check_resume_path

__all__ = ["ExternalLauncher", "RLHFLauncher", "check_ckpt_argument", "watchdog_running"]

_WATCHDOG_RUNNING: list[bool] = [False]


def watchdog_running(value: bool) -> None:
    """Tell the child observer whether the strategy's watchdog handles dead ranks now. Runs on: rank 0."""
    _WATCHDOG_RUNNING[0] = value


def check_ckpt_argument(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Check the ``ckpt_path`` that ``trainer.fit``/``validate`` passed on, before any process or model starts.

    Runs on: the launching process (rank 0, or every rank when processes are created externally).
    """
    ckpt_path = _bound_argument(function, args, kwargs, "ckpt_path")
    check_resume_path(ckpt_path)
    check_resume_lora(ckpt_path, _bound_argument(function, args, kwargs, "model"))


def _bound_argument(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    """The argument ``name`` of the call ``function(*args, **kwargs)`` that the launcher is about to make (None when
    not given or when the call does not bind)."""
    try:
        bound = inspect.signature(function).bind_partial(*args, **kwargs)
    except TypeError:
        return None
    return bound.arguments.get(name)


def _observer_defers() -> bool:
    """Whether Lightning's child observer should stand aside now. Runs on: rank 0 (the observer thread)."""
    return _WATCHDOG_RUNNING[0] or exit_expected()


class RLHFLauncher(SubprocessScriptLauncher):
    """Lightning's subprocess launcher with a child observer that defers to the strategy's watchdog.

    Runs on: rank 0 (it starts ranks 1.. as its children).
    """

    def __init__(self, *args: Any, check_module: Callable[[Any, bool], None] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.check_module = check_module
        """Called with the module that ``trainer.fit``/``validate`` passed on and whether the call is a fit, before
        any rank starts (the strategy's checks that need the world size and the module, e.g. an explicit
        placement)."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        check_ckpt_argument(function, args, kwargs)
        if self.check_module is not None:
            fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
            self.check_module(_bound_argument(function, args, kwargs, "model"), fitting)
        start_subprocess_ranks(self, defer_observer=_observer_defers)
        return function(*args, **kwargs)


class ExternalLauncher(Launcher):
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
