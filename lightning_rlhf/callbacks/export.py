"""``ExportActor``: write the trained actor as a transformers folder when ``fit`` ends, or the best one by a metric.

ExportActor()                                     # the last step, when fit ends
ExportActor(monitor="val/loss", mode="min")       # SFT: the weights of the validation with the lowest loss
ExportActor(monitor="val/score/mean", mode="max") # RL: the weights that scored best on held-out prompts
"""

from __future__ import annotations

import math
import os
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_rlhf.checkpoint.export import CHECKPOINT_KEY, actor_files, export_actor, resolve_dtype
from lightning_rlhf.module import RLHFModule

__all__ = ["ExportActor"]

_MODES = ("min", "max")


class ExportActor(Callback):
    """Export the actor to ``dirpath`` (default ``<run folder>/actor``) at the end of ``fit``, and store its
    config and tokenizer files in every checkpoint so that ``lightning-rlhf export CKPT OUT`` needs nothing else.

    With ``monitor``, the folder holds the weights of the best validation instead of the last step's: after each
    validation whose ``monitor`` value beats the best so far (strictly; a non-finite value never does), the live
    actor is exported at once (docs/sft.md, "Which weights are exported"). The command line adds this callback by
    default (settings under ``export_actor:``). Runs on: every process (the export gathers the shards; rank 0 writes).

    Args:
        dirpath: folder to write; None: ``actor`` inside the run folder (``trainer.log_dir``).
        dtype: weight dtype of the folder (``bfloat16``, ``float16``, ``float32``); None: the strategy's
            ``param_dtype`` if it has one (the dtype the model computed in), else the training dtype (float32).
        export_on_fit_end: write the folder when ``fit`` ends; False only stores the files in checkpoints.
        monitor: a validation metric that picks the exported weights (``val/loss``, ``val/score/mean``); None: the last.
        mode: ``"min"`` (the lowest ``monitor`` value is best, e.g. a loss) or ``"max"`` (e.g. a score).
    """

    def __init__(
        self,
        dirpath: str | None = None,
        *,
        dtype: str | None = None,
        export_on_fit_end: bool = True,
        monitor: str | None = None,
        mode: str = "min",
    ) -> None:
        resolve_dtype(dtype)  # a bad name fails when the callback is made, not after training
        if mode not in _MODES:
            raise ValueError(f"ExportActor(mode={mode!r}): expected one of {list(_MODES)}.")
        if monitor is not None and not export_on_fit_end:
            raise ValueError(
                f"ExportActor(monitor={monitor!r}, export_on_fit_end=False): the monitor picks the weights to export, "
                "but nothing is exported. HINT: keep export_on_fit_end=True, or drop monitor."
            )
        self.dirpath = dirpath
        self.dtype = dtype
        self.export_on_fit_end = export_on_fit_end
        self.monitor = monitor
        self.mode = mode
        self._files: dict[str, bytes] | None = None
        self.last_export: str | None = None
        """The folder of the last export (set on every rank)."""
        self.best_score: float | None = None
        """With ``monitor``: its best value so far (None before the first validation)."""
        self.best_step: int | None = None
        """With ``monitor``: the ``global_step`` whose weights had :attr:`best_score` (those in the folder)."""
        self.export_reason: str | None = None
        """Which step the folder holds and why (``"step 50, the best val/loss (min) of 3 validations: 0.3900"``)."""
        self._validations = 0

    @property
    @override
    def state_key(self) -> str:
        """One state per folder and metric, so several ``ExportActor`` callbacks can be restored side by side."""
        return f"{type(self).__qualname__}{ {'dirpath': self.dirpath, 'monitor': self.monitor, 'mode': self.mode} }"

    @override
    def state_dict(self) -> dict[str, Any]:
        """The best value, its step and folder, and the validations counted (with ``monitor``). Runs on: every rank."""
        if self.monitor is None:
            return {}
        return {
            "monitor": self.monitor,
            "mode": self.mode,
            "best_score": self.best_score,
            "best_step": self.best_step,
            "best_export": self.last_export,
            "validations": self._validations,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the best value and step of the run a checkpoint comes from. Runs on: every process."""
        if self.monitor is None or state_dict.get("monitor") != self.monitor or state_dict.get("mode") != self.mode:
            return
        self.best_score = state_dict.get("best_score")
        self.best_step = state_dict.get("best_step")
        self.last_export = state_dict.get("best_export")
        self._validations = int(state_dict.get("validations", 0))

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Add the actor's config and tokenizer files (a few MB) to the checkpoint. Runs on: every process."""
        if self._files is None:
            self._files = actor_files(_rlhf_module(pl_module))
        checkpoint[CHECKPOINT_KEY] = self._files

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """With ``monitor``: export the actor when the metric beat the best so far.

        Runs on: every process (rank 0's decision is broadcast; the export gathers on every rank).

        Raises:
            KeyError: the validation logged no ``monitor`` metric (names the metrics it logged).
        """
        if self.monitor is None or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        if self.monitor not in trainer.callback_metrics:
            logged = sorted(k for k in trainer.callback_metrics if k.startswith("val"))
            raise KeyError(
                f"ExportActor(monitor={self.monitor!r}): the validation logged no such metric; it logged {logged}. "
                "HINT: monitor one of them (`val/loss` for SFTModule, `val/score/mean` for RL modules)."
            )
        score = float(trainer.callback_metrics[self.monitor])
        improved = math.isfinite(score) and (
            self.best_score is None or (score < self.best_score if self.mode == "min" else score > self.best_score)
        )
        improved = bool(trainer.strategy.broadcast(improved, src=0))  # every rank exports, or none
        self._validations += 1
        if not improved:
            rank_zero_info(
                f"ExportActor: {self.monitor}={score:.4f} at step {trainer.global_step} is not better than "
                f"{self.best_score:.4f} at step {self.best_step} ({self.mode}); the export keeps step {self.best_step}."
                if self.best_score is not None
                else f"ExportActor: {self.monitor}={score} at step {trainer.global_step} is not finite: not exported."
            )
            return
        self.best_score, self.best_step = score, trainer.global_step
        self._export(trainer, pl_module)
        rank_zero_info(
            f"ExportActor: {self.monitor}={score:.4f} at step {self.best_step} is the best so far ({self.mode}): "
            f"actor exported to {self.last_export}"
        )

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Export the actor (without ``monitor``), or say which step the folder holds. Runs on: every process."""
        if not self.export_on_fit_end:
            return
        last = trainer.global_step
        if self.monitor is not None and self.best_step is not None:
            self.export_reason = (
                f"step {self.best_step}, the best {self.monitor} ({self.mode}) of {self._validations} "
                f"validation{'s' if self._validations != 1 else ''}: "
                f"{self.best_score:.4f}" + ("" if self.best_step == last else f"; training ended at step {last}")
            )
            rank_zero_info(f"actor exported to: {self.last_export} ({self.export_reason})")
            return
        if self.monitor is not None:
            rank_zero_warn(
                f"ExportActor(monitor={self.monitor!r}): no validation ran during fit, so the last step ({last}) is "
                "exported. HINT: give the datamodule validation data and set Trainer(val_check_interval=N, "
                "check_val_every_n_epoch=None) to validate every N steps."
            )
        self._export(trainer, pl_module)
        self.export_reason = f"step {last}, the last step" + (
            f" (no {self.monitor} to pick by)" if self.monitor else ""
        )
        rank_zero_info(f"actor exported to: {self.last_export} ({self.export_reason})")

    def _export(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        out = self.dirpath or os.path.join(trainer.log_dir or trainer.default_root_dir, "actor")
        dtype = self.dtype or getattr(trainer.strategy, "param_dtype", None)
        self.last_export = os.path.abspath(export_actor(_rlhf_module(pl_module), out, dtype=dtype))


def _rlhf_module(module: L.LightningModule) -> RLHFModule:
    if not isinstance(module, RLHFModule):
        raise TypeError(
            f"ExportActor exports the actor of an RLHFModule, got `{type(module).__name__}`. "
            "HINT: remove the callback, or train a lightning_rlhf module."
        )
    return module
