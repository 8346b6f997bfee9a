"""A resumed run keeps the rows its ``metrics.csv`` had: Lightning's CSV logger deletes the file of a run folder it
opens again, and the recipes write into a fixed folder (``version: ""``), so a resume would start the file at the
resumed step. The rows of the steps before the checkpoint are read before the logger opens the folder and written
back with the first save; rows of steps the resumed run repeats (logged after the checkpoint) are dropped."""

from __future__ import annotations

import csv
import os
from typing import Any

import lightning as L
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

__all__ = ["ResumedMetrics"]


class ResumedMetrics(L.Callback):
    """Keeps a resumed run's earlier ``metrics.csv`` rows in every CSV logger whose folder the run reopens. Made by
    ``RLHFStrategy.setup_environment`` with :meth:`read`, before Lightning opens the loggers. Runs on: rank 0 (the
    loggers write there)."""

    def __init__(self, rows: dict[int, list[dict[str, str]]] | None = None) -> None:
        self._rows = rows or {}  # per logger (by its index): its file's rows before the run opened it

    @classmethod
    def install(cls, trainer: L.Trainer) -> None:
        """Add the callback (:meth:`read` now) to ``trainer``, in place of one an earlier ``fit`` added. Runs on:
        every process, before the set-up hooks (``RLHFStrategy.setup_environment``)."""
        callbacks: list[L.Callback] = getattr(trainer, "callbacks")  # noqa: B009 (set by Lightning, undeclared)
        callbacks[:] = [c for c in callbacks if not isinstance(c, cls)] + [cls.read(trainer)]

    @classmethod
    def read(cls, trainer: L.Trainer) -> ResumedMetrics:
        """The callback with the rows of the loggers' files as they are now (rank 0; other ranks keep none). Runs
        on: every process, at the start of ``fit`` (before the set-up hooks, which open the loggers)."""
        rows: dict[int, list[dict[str, str]]] = {}
        for i, logger in enumerate(trainer.loggers if trainer.global_rank == 0 else ()):
            path = _metrics_file(logger)
            if path is not None and os.path.isfile(path):
                with open(path, newline="") as f:
                    rows[i] = list(csv.DictReader(f))
        return cls(rows)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Put the rows of the steps before the restored one (none in a run that starts at step 0) back in front of
        the run's own. Runs on: rank 0."""
        rows_of, self._rows = self._rows, {}
        for i, rows in rows_of.items():
            kept = [r for r in rows if _step(r) < trainer.global_step]
            if kept:
                writer: Any = getattr(trainer.loggers[i], "experiment")  # noqa: B009 (Logger does not declare it)
                writer.metrics[:0] = [{k: v for k, v in r.items() if v != ""} for r in kept]


def _metrics_file(logger: Any) -> str | None:
    """The ``metrics.csv`` a CSV logger writes, or None for another logger (without opening its folder)."""
    if not isinstance(logger, CSVLogger):
        return None
    return os.path.join(logger.log_dir, "metrics.csv")


def _step(row: dict[str, str]) -> int:
    """A row's ``step`` (rows without one count as before every step)."""
    try:
        return int(float(row.get("step") or -1))
    except ValueError:
        return -1
