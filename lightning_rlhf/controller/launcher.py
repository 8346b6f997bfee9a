"""Process launchers: Lightning's, minus the observer that SIGKILLs rank 0 when a child dies, plus the checks the
strategy hands them (the resume path, the placement), run before anything starts.

Lightning's child observer SIGKILLs every process within 5 s of a child rank exiting non-zero, so nothing could name
the dead rank; here it defers to the strategy's watchdog while that runs, and stands aside during a preemption exit
(docs/faults.md). The Lightning internals involved live in :mod:`lightning_rlhf.compat.lightning`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_rlhf.compat.lightning import Launcher, SubprocessScriptLauncher, start_subprocess_ranks
from lightning_rlhf.controller.liveness import exit_expected

__all__ = ["ExternalLauncher", "LaunchCheck", "RLHFLauncher", "watchdog_running"]

LaunchCheck = Callable[[Mapping[str, Any], bool], None]
"""A check run before the launch: ``(arguments, fitting)``, the arguments of the call ``trainer.fit``/``validate``
is about to make (``model``, ``ckpt_path``, ...) and whether it is a fit; it raises to stop the launch."""

_WATCHDOG_RUNNING: list[bool] = [False]


def watchdog_running(value: bool) -> None:
    """Tell the child observer whether the strategy's watchdog handles dead ranks now. Runs on: rank 0."""
    _WATCHDOG_RUNNING[0] = value


def _run_checks(
    checks: Sequence[LaunchCheck],
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    trainer: Any,
) -> None:
    """Run ``checks`` on the call ``function(*args, **kwargs)`` the launcher is about to make (its bound arguments;
    none when the call does not bind). Runs on: the launching process."""
    try:
        arguments = dict(inspect.signature(function).bind_partial(*args, **kwargs).arguments)
    except TypeError:
        arguments = {}
    fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
    for check in checks:
        check(arguments, fitting)


class RLHFLauncher(SubprocessScriptLauncher):
    """Lightning's subprocess launcher with a child observer that defers to the strategy's watchdog. Runs on: rank 0
    (it starts ranks 1.. as its children)."""

    def __init__(self, *args: Any, checks: Sequence[LaunchCheck] = (), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checks = checks
        """Run before any rank starts (:data:`LaunchCheck`: the strategy's checks of the resume path, and of what
        needs the world size and the module, e.g. an explicit placement)."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        _run_checks(self.checks, function, args, kwargs, trainer)
        # Lightning's child observer (a thread of rank 0) stands aside while the watchdog runs or the run is exiting.
        start_subprocess_ranks(self, defer_observer=lambda: _WATCHDOG_RUNNING[0] or exit_expected())
        return function(*args, **kwargs)


class ExternalLauncher(Launcher):
    """For processes started outside Lightning (torchrun, SLURM): starts nothing, runs ``checks`` (the resume path).

    Runs on: every rank.
    """

    def __init__(self, checks: Sequence[LaunchCheck] = ()) -> None:
        self.checks = checks

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return True

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        _run_checks(self.checks, function, args, kwargs, trainer)
        return function(*args, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        """Nothing to kill: the processes were not started here."""
