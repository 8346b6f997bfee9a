"""``RLHFProgressBar``: Lightning's tqdm bar with short names for the step metrics ``log_step`` puts on it."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from typing_extensions import override

__all__ = ["SHORT_NAMES", "RLHFProgressBar"]

#: logged name -> name on the bar
SHORT_NAMES = {"critic/score/mean": "reward", "response_length/mean": "len", "timing_s/step": "s/step"}


class RLHFProgressBar(TQDMProgressBar):
    """Lightning's ``TQDMProgressBar`` showing ``reward=0.61, len=4.2, s/step=1.3`` rather than the full metric
    names (``critic/score/mean``, ``response_length/mean``, ``timing_s/step``). Lightning's default bar shows
    the same values under their full names; this one only shortens them.

    Runs on: every rank; Lightning draws the bar on rank 0 only.

    Args:
        short_names: logged name -> name on the bar; other metrics keep their names.
        **kwargs: passed to ``TQDMProgressBar`` (``refresh_rate``, ``leave``).
    """

    def __init__(self, short_names: dict[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.short_names = dict(SHORT_NAMES if short_names is None else short_names)

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """The bar's items with short names. Runs on: rank 0."""
        return {self.short_names.get(k, k): v for k, v in super().get_metrics(trainer, pl_module).items()}
