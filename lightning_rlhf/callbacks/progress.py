"""``RLHFProgressBar``: Lightning's tqdm bar counting RL steps (``step 37/150``), with short names for the step
metrics ``log_step`` puts on it."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

__all__ = ["SHORT_NAMES", "RLHFProgressBar"]

#: logged name -> name on the bar
SHORT_NAMES = {"critic/score/mean": "reward", "response_length/mean": "len", "timing_s/step": "s/step"}


class RLHFProgressBar(TQDMProgressBar):
    """Lightning's ``TQDMProgressBar`` counting RL steps over the whole run, ``step 37/150``, and showing
    ``reward=0.61, len=4.2, s/step=1.3`` rather than the full metric names (docs/quickstart.md).

    Lightning's bars start again at every epoch; an RL run is measured in steps, so the training bar is one bar
    for the run: ``trainer.global_step`` out of ``trainer.estimated_stepping_batches`` (no total when the run has
    no end), a resumed run starting where it stopped. Runs on: every rank; Lightning draws the bar on rank 0 only.

    Args:
        short_names: logged name -> name on the bar; other metrics keep their names.
        **kwargs: passed to ``TQDMProgressBar`` (``refresh_rate``: redraw every this many steps).
    """

    def __init__(self, short_names: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.short_names = dict(SHORT_NAMES if short_names is None else short_names)
        self.total_steps: int | None = None
        """The run's steps (set when training starts), or None for a run with no end."""

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """The bar's items with short names. Runs on: rank 0."""
        return {self.short_names.get(k, k): v for k, v in super().get_metrics(trainer, pl_module).items()}

    def step_description(self, trainer: L.Trainer) -> str:
        """``step <global_step>/<total steps>`` (``step <global_step>`` for a run with no end). Runs on: rank 0."""
        total = f"/{self.total_steps}" if self.total_steps is not None else ""
        return f"step {trainer.global_step}{total}"

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Make the run's step bar: its total steps, and the steps already done (a resumed run). Runs on: rank 0."""
        super().on_train_start(trainer, pl_module)
        total = float(trainer.estimated_stepping_batches)  # inf (or -1: an endless iterable) when there is no end
        self.total_steps = int(total) if math.isfinite(total) and total > 0 else None
        bar = self.train_progress_bar
        bar.reset(total=self.total_steps)
        bar.initial = bar.n = trainer.global_step  # tqdm's rate counts from `initial`
        bar.set_description(self.step_description(trainer))

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, *_: Any) -> None:
        """Nothing: the step bar goes on over epochs (Lightning's bar starts again at each). Runs on: rank 0."""

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Move the bar to ``global_step`` every ``refresh_rate`` steps and at the last. Runs on: rank 0."""
        bar, step = self.train_progress_bar, trainer.global_step
        if self.is_enabled and (step % self.refresh_rate == 0 or step == self.total_steps):
            bar.n = step
            bar.set_description(self.step_description(trainer), refresh=False)
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # redraws

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Show the epoch's last metrics; the bar stays open for the next epoch. Runs on: rank 0."""
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
