"""``ExportActor``: write the trained actor as a transformers folder when ``fit`` ends."""

from __future__ import annotations

import os
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_rlhf.export import CHECKPOINT_KEY, actor_files, export_actor, resolve_dtype
from lightning_rlhf.module import RLHFModule

__all__ = ["ExportActor"]


class ExportActor(Callback):
    """Export the actor to ``dirpath`` (default ``<run folder>/actor``) at the end of ``fit``, and store its
    config and tokenizer files in every checkpoint so that ``lightning-rlhf export CKPT OUT`` needs nothing else.

    The folder loads with ``AutoModelForCausalLM.from_pretrained`` and with vLLM. The command line adds this
    callback by default (settings under ``export_actor:``).

    Runs on: every process (the export gathers the actor's shards; rank 0 writes).

    Args:
        dirpath: folder to write; None: ``actor`` inside the run folder (``trainer.log_dir``, else
            ``trainer.default_root_dir``).
        dtype: weight dtype of the folder (``bfloat16``, ``float16``, ``float32``); None: the strategy's
            ``param_dtype`` if it has one (the dtype the model computed in), else the training dtype (float32).
        export_on_fit_end: write the folder when ``fit`` ends; False only stores the files in checkpoints.
    """

    def __init__(self, dirpath: str | None = None, *, dtype: str | None = None, export_on_fit_end: bool = True) -> None:
        resolve_dtype(dtype)  # a bad name fails when the callback is made, not after training
        self.dirpath = dirpath
        self.dtype = dtype
        self.export_on_fit_end = export_on_fit_end
        self._files: dict[str, bytes] | None = None
        self.last_export: str | None = None
        """The folder of the last export (set on every rank)."""

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Add the actor's config and tokenizer files (a few MB) to the checkpoint. Runs on: every process."""
        if self._files is None:
            self._files = actor_files(_rlhf_module(pl_module))
        checkpoint[CHECKPOINT_KEY] = self._files

    @override
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Export the actor. Runs on: every process (collective gathers; rank 0 writes)."""
        if not self.export_on_fit_end:
            return
        out = self.dirpath or os.path.join(trainer.log_dir or trainer.default_root_dir, "actor")
        dtype = self.dtype or getattr(trainer.strategy, "param_dtype", None)
        self.last_export = os.path.abspath(export_actor(_rlhf_module(pl_module), out, dtype=dtype))
        rank_zero_info(f"actor exported to: {self.last_export}")


def _rlhf_module(module: L.LightningModule) -> RLHFModule:
    if not isinstance(module, RLHFModule):
        raise TypeError(
            f"ExportActor exports the actor of an RLHFModule, got `{type(module).__name__}`. "
            "HINT: remove the callback, or train a lightning_rlhf module."
        )
    return module
