"""What the run-summary and plot callbacks share: the run folder, the step number, and a per-step history of
the metrics the controller logged (kept on rank 0, saved in checkpoints so a resumed run plots the whole run).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import lightning as L
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from typing_extensions import override

from lightning_rlhf.compat.lightning import batches_that_stepped

__all__ = ["MetricHistory", "first_last", "run_folder", "step_of"]


def run_folder(trainer: L.Trainer) -> str:
    """The run's folder, as ``trainer.log_dir`` names it, without its broadcast (so one rank may ask): the first
    logger's ``log_dir`` (CSV, TensorBoard) or ``save_dir`` (others), else ``trainer.default_root_dir``. Runs on: rank 0
    (any process gets its own logger's answer)."""
    folder: str | None = None
    if trainer.loggers:
        first = trainer.loggers[0]
        folder = first.log_dir if isinstance(first, CSVLogger | TensorBoardLogger) else first.save_dir
    return os.path.abspath(folder or trainer.default_root_dir)


def step_of(trainer: L.Trainer) -> int:
    """The step the loggers give the batch that just ran (``metrics.csv``'s ``step``, from 0), in
    ``on_train_batch_end``. Runs on: any."""
    return batches_that_stepped(trainer)


def first_last(values: Sequence[float], fraction: float = 0.1) -> tuple[float, float]:
    """Means of the first and the last ``fraction`` of ``values`` (at least one value each). Runs on: any."""
    if not values:
        raise ValueError("first_last: no values. HINT: call it once at least one step was logged.")
    k = max(1, int(len(values) * fraction))
    return sum(values[:k]) / k, sum(values[-k:]) / k


class MetricHistory(L.Callback):
    """Records, after every training step, the latest value of each metric in ``keys`` that the module logged.

    Runs on: rank 0 records (the controller logged the values there). The history is in the callback's checkpointed
    state, so it covers the whole run after a resume; a metric never logged is simply absent.
    """

    def __init__(self, keys: Iterable[str]) -> None:
        self.keys = tuple(dict.fromkeys(keys))
        self.history: dict[str, list[tuple[int, float]]] = {}

    def values(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` recorded for ``key`` (empty lists if it was never logged). Runs on: rank 0."""
        pairs = self.history.get(key, [])
        return [s for s, _ in pairs], [v for _, v in pairs]

    def first_present(self, candidates: Sequence[str]) -> str | None:
        """The first of ``candidates`` with recorded values, or None. Runs on: rank 0."""
        return next((k for k in candidates if self.history.get(k)), None)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Record this step's values. Runs on: every rank; only rank 0 records."""
        if not trainer.is_global_zero:
            return
        record(self.history, self.keys, step_of(trainer), trainer.callback_metrics)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": {k: [list(p) for p in v] for k, v in self.history.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = {k: [(int(s), float(v)) for s, v in pairs] for k, pairs in state_dict["history"].items()}


def record(series: dict[str, list[tuple[int, float]]], keys: Iterable[str], step: int, metrics: Any) -> None:
    """Append each of ``keys`` found in ``metrics`` to ``series`` at ``step``; a step recorded twice (a restarted
    batch, two validations at one step) keeps the last value. Runs on: rank 0."""
    for key in keys:
        if key in metrics:
            pairs = series.setdefault(key, [])
            if pairs and pairs[-1][0] == step:
                pairs.pop()
            pairs.append((step, float(metrics[key])))
