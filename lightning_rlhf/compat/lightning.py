"""Every use of Lightning's private state, in one place, for the Lightning versions in :data:`SUPPORTED_LIGHTNING`.

RLHFStrategy changes what a training step is (one RL iteration, run by a controller on rank 0) and when a run stops
(every rank after the same step, on a preemption signal); Lightning has no public hooks for some of that. Each private
access is a small function whose docstring names it and why it is needed, tested against a real
``Trainer``/``ModelParallelStrategy`` in ``tests/unit/test_compat.py`` (which also checks that no other module of the
package touches Lightning's private names).

Why ``>=2.6,<2.7``: checked against Lightning 2.6 (the tested install is 2.6.6); private state carries no
compatibility promise between minor releases (``manual_loop`` became ``manual_optimization`` in 2.0, the
child-process observer appeared in 2.2), and 2.5 cannot be tested here. To support a new minor release: install it,
run ``tests/unit/test_compat.py``, fix what fails here, then move the upper bound here and in ``pyproject.toml``.

Runs on: any process (a leaf module: it imports Lightning and nothing from ``lightning_rlhf``).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import lightning
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import Strategy

__all__ = [
    "SUPPORTED_LIGHTNING",
    "DeferringChildObserver",
    "Launcher",
    "SubprocessScriptLauncher",
    "attached_trainer",
    "batches_that_stepped",
    "check_lightning_version",
    "count_optimizer_step",
    "request_stop",
    "run_validation_between_steps",
    "set_batches_that_stepped",
    "set_data_parallel_size",
    "set_launcher",
    "start_subprocess_ranks",
]

SUPPORTED_LIGHTNING = ">=2.6,<2.7"
"""The Lightning versions whose private state this module is written (and tested) against."""

Launcher = _Launcher
"""Lightning's launcher base class (``lightning.pytorch.strategies.launchers.launcher._Launcher``): a strategy's
launcher must be one. Re-exported for :class:`~lightning_rlhf.controller.launcher.ExternalLauncher`."""

SubprocessScriptLauncher = _SubprocessScriptLauncher
"""Lightning's launcher that starts ranks 1.. by re-running the script
(``lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher``); its ``procs`` lists the
children it started. Re-exported for :class:`~lightning_rlhf.controller.launcher.RLHFLauncher`."""


def check_lightning_version(version: str | None = None) -> None:
    """Refuse a Lightning ``version`` (None: the installed one) outside :data:`SUPPORTED_LIGHTNING`, whose private
    state this module was not checked on (``RuntimeError``; ``ValueError`` for a string that is not a version). Runs
    on: any process (``RLHFStrategy.__init__``, before anything starts).
    """
    installed = lightning.__version__ if version is None else version
    try:
        parsed = Version(installed)
    except InvalidVersion:
        raise ValueError(
            f"lightning version {installed!r} is not a valid version number, so it cannot be checked against the "
            f"supported range {SUPPORTED_LIGHTNING!r}. HINT: pip install 'lightning{SUPPORTED_LIGHTNING}'."
        ) from None
    if not SpecifierSet(SUPPORTED_LIGHTNING).contains(parsed, prereleases=True):
        raise RuntimeError(
            f"lightning_rlhf supports lightning{SUPPORTED_LIGHTNING}, but lightning {installed} is installed (the "
            "strategy relies on Lightning internals that change between minor releases). "
            f"HINT: pip install 'lightning{SUPPORTED_LIGHTNING}'."
        )


# ----------------------------------------------------------------------------------------------- the loops
def batches_that_stepped(trainer: pl.Trainer) -> int:
    """The step number loggers give the current batch's metrics. Private attribute:
    ``trainer.fit_loop.epoch_loop._batches_that_stepped`` (the counter Lightning's logger connector and its
    ``LearningRateMonitor`` log at; no public accessor). Runs on: any process.
    """
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def set_batches_that_stepped(trainer: pl.Trainer, n: int) -> None:
    """Make loggers place the coming step's metrics at step ``n``. Private attribute:
    ``trainer.fit_loop.epoch_loop._batches_that_stepped``. RLHFStrategy sets it to ``global_step`` before each RL
    iteration: they agree (one batch, one step) except after resuming from a checkpoint saved after a validation on the
    last batch, which Lightning's restore counts as one more batch. Runs on: every rank.
    """
    trainer.fit_loop.epoch_loop._batches_that_stepped = n


def count_optimizer_step(trainer: pl.Trainer) -> None:
    """Count one optimizer step in ``trainer.global_step`` (ready and completed). Private state:
    ``trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress`` (a ``_Progress`` of Lightning's private
    manual-optimization loop), from which ``global_step`` is computed. The roles step raw optimizers that Lightning
    never sees, so RLHFStrategy counts one step per RL iteration itself; ``max_steps``, checkpoint intervals and loggers
    then follow RL iterations. Runs on: every rank.
    """
    progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
    progress.increment_ready()
    progress.increment_completed()


def request_stop(trainer: pl.Trainer, flag: bool) -> None:
    """Ask Lightning's loops to stop (``flag=True``) or not (``False``) as if SIGTERM had been received. Private
    attribute: ``trainer._signal_connector.received_sigterm`` (``trainer.received_sigterm`` reads it but has no setter).
    With it set, Lightning's training loop raises ``SIGTERMException`` at the end of the current batch, after its
    callbacks, and the evaluation loop stops after its current batch; RLHFStrategy sets it when every rank agreed to
    stop on a preemption signal, and clears it while a validation at that step runs. Runs on: every rank.
    """
    trainer._signal_connector.received_sigterm = flag


def run_validation_between_steps(trainer: pl.Trainer) -> bool:
    """Run one whole validation now, from inside ``fit`` (e.g. in ``on_train_start``), the way Lightning's training
    epoch loop runs one between two steps. Returns False when there was nothing to validate (no validation batches),
    True otherwise. Private state: the validation loop ``trainer.fit_loop.epoch_loop.val_loop`` (Lightning's private
    ``_EvaluationLoop``: its ``restarting``, ``run()`` and ``skip``) and ``trainer._logger_connector._first_loop_iter``,
    which the training loop's step-level logging depends on and a validation resets: it is saved and restored around the
    run, as ``_TrainingEpochLoop.on_advance_end`` does. ``restarting`` is cleared so a restored checkpoint's half-done
    validation is not resumed. Runs on: every rank (the validation is collective).
    """
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    val_loop.restarting = False
    trainer.validating = True  # so the trainer's active loop is the validation loop
    first_loop_iter = trainer._logger_connector._first_loop_iter
    val_loop.run()
    trainer.training = True
    trainer._logger_connector._first_loop_iter = first_loop_iter
    return not val_loop.skip


def attached_trainer(module: pl.LightningModule) -> pl.Trainer | None:
    """The trainer ``module`` is attached to, or None (where ``module.trainer`` would raise). Private attribute:
    ``LightningModule._trainer``. Runs on: any process."""
    return module._trainer


# -------------------------------------------------------------------------------------------- the strategy
def set_data_parallel_size(strategy: Strategy, n: int) -> None:
    """Make ``ModelParallelStrategy.setup_environment`` build a device mesh with ``n`` data-parallel replicas. Private
    attribute: ``ModelParallelStrategy._data_parallel_size`` (its constructor argument; ``"auto"`` means one replica per
    node, tensor parallelism inside). RLHFStrategy needs one replica per rank (a 1-D data-parallel mesh), which is only
    known once the number of nodes and processes is; set it before ``setup_environment`` builds the mesh. Runs on: every
    rank.
    """
    if not hasattr(strategy, "_data_parallel_size"):
        raise TypeError(
            f"set_data_parallel_size: {type(strategy).__name__} has no data-parallel size. "
            "HINT: pass a lightning.pytorch.strategies.ModelParallelStrategy (or a subclass such as RLHFStrategy)."
        )
    strategy._data_parallel_size = n


def set_launcher(strategy: Strategy, launcher: _Launcher | None) -> None:
    """Install ``launcher`` as the strategy's launcher (``strategy.launcher`` then returns it). Private attribute:
    ``Strategy._launcher``, which a strategy's ``_configure_launcher`` hook (called by the Trainer's accelerator
    connector) is meant to set; ``strategy.launcher`` has no setter. Runs on: every rank.
    """
    strategy._launcher = launcher


def checkpoint_metadata_filename() -> str:
    """The file of a sharded (folder) checkpoint that holds everything but the tensors (loops, callbacks,
    schedules), which Lightning's FSDP2 strategy writes from rank 0 and reads back on resume. Private name:
    ``lightning.fabric.utilities.load._METADATA_FILENAME``. Runs on: any process.
    """
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    return str(_METADATA_FILENAME)


# -------------------------------------------------------------------------------------------- the launcher
class DeferringChildObserver(_ChildProcessObserver):
    """Lightning's child-process observer, standing aside while ``defer()`` is true. Lightning's observer
    (``lightning.fabric.strategies.launchers.subprocess_script._ChildProcessObserver``, a thread checking the children
    every ``sleep_period`` seconds in its private ``_run``) SIGKILLs every process, rank 0 included, once a child exits
    non-zero. While ``defer()`` returns true it only waits for the children to exit (another component handles a dead
    rank, or the exit is expected); otherwise it does what Lightning's does. Private state used: the ``_run`` method it
    overrides and the ``_child_processes`` list. Runs on: rank 0 (a daemon thread).
    """

    def __init__(
        self,
        main_pid: int,
        child_processes: list[subprocess.Popen[Any]],
        defer: Callable[[], bool],
        sleep_period: float = 5,
    ) -> None:
        super().__init__(main_pid=main_pid, child_processes=child_processes, sleep_period=sleep_period)  # type: ignore[arg-type]
        self.defer = defer

    @override
    def _run(self) -> bool:
        if self.defer():
            for proc in self._child_processes:
                proc.poll()
            return all(proc.returncode is not None for proc in self._child_processes)
        return super()._run()


def start_subprocess_ranks(launcher: _SubprocessScriptLauncher, defer_observer: Callable[[], bool]) -> None:
    """What ``_SubprocessScriptLauncher.launch`` does before calling the function, with a
    :class:`DeferringChildObserver` in place of Lightning's observer: validate the cluster settings, start ranks 1..
    (unless the processes are created externally), and set the torch thread count per process. Private state:
    ``_SubprocessScriptLauncher._call_children_scripts`` and
    ``lightning.fabric.utilities.distributed._set_num_threads_if_needed``. Runs on: rank 0 (every rank when the
    processes are created externally).
    """
    env = launcher.cluster_environment
    env.validate_settings(num_devices=launcher.num_processes, num_nodes=launcher.num_nodes)
    if not env.creates_processes_externally:
        launcher._call_children_scripts()
        DeferringChildObserver(main_pid=os.getpid(), child_processes=launcher.procs, defer=defer_observer).start()
    _set_num_threads_if_needed(num_processes=launcher.num_processes)
