"""``RunSummary``: one screen at the end of ``fit``: reward start -> end, speed, and where everything is."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from typing_extensions import override

from lightning_rlhf.callbacks.history import MetricHistory, first_last, record, run_folder

__all__ = ["REWARD_KEYS", "SUMMARY_KEYS", "VALIDATION_KEYS", "RunSummary", "checkpoint_line"]

#: where the learning curve is, in order of preference: DAPO's score before its selection, else the mean score
REWARD_KEYS = ("dynamic_sampling/raw_score/mean", "critic/score/mean")
#: what the summary's first line reports: the reward, or for a supervised run (SFTModule) its loss
SUMMARY_KEYS = (*REWARD_KEYS, "sft/loss")
#: validation metrics the summary reports, first and last validation (the first found is shown)
VALIDATION_KEYS = ("val/score/mean", "val/loss")


def checkpoint_line(ckpt: Any) -> str | None:
    """``checkpoints: <folder> (best (<monitor>=<value>): <path>, last: <path>)``, or None when ``ckpt`` is not a
    ``ModelCheckpoint`` or saved nothing. Without a ``monitor``, Lightning's ``best_model_path`` is merely the newest
    checkpoint kept, named "latest" here. Runs on: rank 0."""
    if not isinstance(ckpt, ModelCheckpoint) or not (ckpt.best_model_path or ckpt.last_model_path):
        return None
    parts = []
    if ckpt.best_model_path:
        label = "latest"
        if ckpt.monitor is not None:
            score = ckpt.best_model_score
            label = f"best ({ckpt.monitor}={float(score):.4g})" if score is not None else f"best ({ckpt.monitor})"
        parts.append(f"{label}: {ckpt.best_model_path}")
    if ckpt.last_model_path:
        parts.append(f"last: {ckpt.last_model_path}")
    return f"  checkpoints: {ckpt.dirpath} ({', '.join(parts)})"


class RunSummary(MetricHistory):
    """Print a summary of the run when ``fit`` ends: reward start -> end, validation, steps and time, throughput,
    the run folder, checkpoints and the exported model, each line when there is something to say (an example is in
    docs/quickstart.md).

    Runs on: every rank; rank 0 records and prints (to stdout), in the ``teardown`` hook of ``fit``: after every
    callback's ``on_fit_end``, and only when ``fit`` ended without an error.

    Args:
        reward_keys: the reward metric (or a supervised run's loss), the first of these that was logged.
        fraction: the share of steps averaged at the start and at the end.
    """

    def __init__(self, reward_keys: Sequence[str] = SUMMARY_KEYS, fraction: float = 0.1) -> None:
        super().__init__([*reward_keys, "perf/throughput", "timing_s/step"])
        if not 0 < fraction <= 0.5:
            raise ValueError(f"RunSummary(fraction={fraction}) must be in (0, 0.5]. HINT: 0.1 = first/last 10%.")
        self.reward_keys = tuple(reward_keys)
        self.fraction = fraction
        self._started: float | None = None
        self.text: str | None = None
        self.validations: dict[str, list[tuple[int, float]]] = {}
        """Each validation's value of the :data:`VALIDATION_KEYS` logged, with the step it measured (rank 0)."""

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Start the wall clock (model loading included). Runs on: every rank."""
        if stage == "fit":
            self._started = time.perf_counter()

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Record the validation's metrics at the current ``global_step``. Runs on: every rank; rank 0 records."""
        if trainer.is_global_zero and not trainer.sanity_checking:
            record(self.validations, VALIDATION_KEYS, trainer.global_step, trainer.callback_metrics)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "validations": {k: [list(p) for p in v] for k, v in self.validations.items()}}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        saved = state_dict.get("validations", {})
        self.validations = {k: [(int(s), float(v)) for s, v in pairs] for k, pairs in saved.items()}

    def validation_line(self) -> str | None:
        """``validation (<key>): <first> before training (step 0) -> <last> at step N``, or None when no
        validation ran. Runs on: rank 0."""
        key = next((k for k in VALIDATION_KEYS if self.validations.get(k)), None)
        if key is None:
            return None
        series = self.validations[key]
        (first_step, first), (last_step, last) = series[0], series[-1]
        start = "before training (step 0)" if first_step == 0 else f"at step {first_step}"
        if len(series) == 1:
            return f"  validation ({key}): {first:.3f} {start}"
        return f"  validation ({key}): {first:.3f} {start} -> {last:.3f} at step {last_step}"

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Print the summary after a ``fit`` that ended normally. Runs on: every rank; rank 0 prints."""
        if stage != "fit" or not trainer.is_global_zero:
            return
        seconds = time.perf_counter() - self._started if self._started is not None else None
        self.text = self.summarize(trainer, seconds)
        print(self.text, flush=True)

    def summarize(self, trainer: L.Trainer, seconds: float | None) -> str:
        """The summary text of what was recorded. Runs on: rank 0."""
        pct = f"{self.fraction:.0%}"
        lines = ["lightning_rlhf run summary"]
        key = self.first_present(self.reward_keys)
        if key is None:
            lines.append(f"  reward: none of {list(self.reward_keys)} was logged")
        else:
            first, last = first_last(self.values(key)[1], self.fraction)
            what = "loss" if key == "sft/loss" else "reward"
            lines.append(f"  {what} ({key}): {first:.3f} (first {pct} of steps) -> {last:.3f} (last {pct})")
        validation = self.validation_line()
        if validation:
            lines.append(validation)
        steps = len(self.values(key)[1]) if key else trainer.global_step
        timing = self.values("timing_s/step")[1]
        line = f"  steps: {steps}"
        if seconds is not None:
            line += f" in {seconds:.0f}s"
        if timing:
            line += f" ({sum(timing) / len(timing):.2f} s/step)"
        lines.append(line)
        throughput = self.values("perf/throughput")[1]
        if throughput:
            per_rank = sum(throughput) / len(throughput)
            world = trainer.world_size
            lines.append(
                f"  throughput: {per_rank:,.0f} tokens/s per rank, {per_rank * world:,.0f} tokens/s over {world} "
                f"rank{'s' if world > 1 else ''} (perf/throughput, mean)"
            )
        lines.append(f"  run folder: {run_folder(trainer)}")
        checkpoints = checkpoint_line(trainer.checkpoint_callback)
        if checkpoints:
            lines.append(checkpoints)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            exported: Any = getattr(callback, "last_export", None)
            if exported:
                reason = getattr(callback, "export_reason", None)
                lines.append(f"  exported model: {exported}" + (f" ({reason})" if reason else ""))
        return "\n".join(lines)
