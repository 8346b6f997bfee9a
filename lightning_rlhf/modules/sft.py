"""``SFTModule``: supervised fine-tuning (a warm start before RL) on the same roles, strategy and checkpoints; only
the actor role exists, and no rollout engine is made."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from lightning_rlhf.batch import Batch
from lightning_rlhf.config import AlgorithmConfig, BatchingConfig, OptimConfig, RolloutConfig, ValidationConfig
from lightning_rlhf.config.models import ensure_pad_token, resolve_model_path
from lightning_rlhf.engines.train.lora import resolve_lora
from lightning_rlhf.module import RLHFModule
from lightning_rlhf.roles import ActorRole
from lightning_rlhf.roles.base import check_pretrained

__all__ = ["SFTModule"]


class SFTModule(RLHFModule):
    """Supervised fine-tuning of a causal LM: the loss on the answer tokens (and EOS) given the prompt.

    Runs on: every process. ``training_step`` runs on the controller (rank 0) and sends each batch to
    :meth:`ActorRole.sft_step <lightning_rlhf.roles.ActorRole.sft_step>`, which every rank runs on its share:
    one optimizer step per training step, the loss a token mean over all ranks. Logs ``sft/loss``,
    ``sft/grad_norm``, ``sft/lr``, ``sft/tokens`` and ``timing_s/step``; with validation data, ``val/loss``
    (token mean over the whole validation set). Use it with :class:`~lightning_rlhf.data.SFTDataModule`.

    Args:
        actor: local folder, hub id or embedded name (``lightning-rlhf/tiny-random``) of the causal LM.
        optim: AdamW and schedule (``lr`` 1e-5 by default, a usual SFT rate for 0.5B-7B models).
        micro_batch_size: examples per forward/backward pass on each rank (gradients accumulate over them).
        validate_before_train: compute ``val/loss`` once before the first step (the starting point).
        lora: train LoRA adapters instead of every weight, as ``RLHFModule(lora=...)`` (docs/lora.md).
    """

    def __init__(
        self,
        actor: str,
        *,
        tokenizer: str | None = None,
        optim: OptimConfig | None = None,
        micro_batch_size: int = 8,
        validate_before_train: bool = False,
        lora: Any = None,
    ) -> None:
        # Not RLHFModule.__init__: it builds the reward and the other RL roles. What the strategy and the
        # callbacks read from an RLHFModule is set here.
        L.LightningModule.__init__(self)
        from transformers import AutoTokenizer

        if micro_batch_size < 1:
            raise ValueError(f"SFTModule(micro_batch_size={micro_batch_size}) must be >= 1.")
        actor = check_pretrained(actor, setting="SFTModule(actor=...)")  # a folder or hub id from here on
        if tokenizer is not None:
            tokenizer = resolve_model_path(tokenizer, setting="SFTModule(tokenizer=...)", tokenizer_only=True)
        self.automatic_optimization = False  # the actor steps its own optimizer
        self.rollout_config = RolloutConfig(n=1)
        self.algorithm = AlgorithmConfig(batching=BatchingConfig(micro_batch_size=micro_batch_size))
        self.validation_config = ValidationConfig(before_train=validate_before_train)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or actor)
        ensure_pad_token(self.tokenizer, source=tokenizer or actor)
        self.actor = ActorRole(
            actor,
            tokenizer=self.tokenizer,
            rollout=self.rollout_config,
            algorithm=self.algorithm,
            optim=optim or OptimConfig(lr=1e-5),
            lora=resolve_lora(lora, setting="SFTModule(lora=...)", task_type="CAUSAL_LM", model=actor),
        )
        self.actor.needs_rollout_engine = False  # supervised steps only: no generation
        self._step_logs: list[tuple[str, float, dict[str, Any]]] | None = None
        self._max_sequence_length: int | None = None

    @property
    def max_sequence_length(self) -> int | None:
        """The longest example the actor's positions cover (None: its config states none), for
        :class:`~lightning_rlhf.data.SFTDataModule`'s check. Runs on: every process (reads ``config.json`` once)."""
        if self._max_sequence_length is None:
            from transformers import AutoConfig

            from lightning_rlhf.engines.rollout.hf import model_max_length

            self._max_sequence_length = model_max_length(AutoConfig.from_pretrained(self.actor.path))
        return self._max_sequence_length

    def setup(self, stage: str) -> None:
        """Check that a batch splits evenly over the ranks, before any model loads. Runs on: every process."""
        batch_size = getattr(getattr(self.trainer, "datamodule", None), "batch_size", None)
        world = self.trainer.world_size
        if stage == "fit" and batch_size and batch_size % world:
            raise ValueError(
                f"SFTDataModule(batch_size={batch_size}) does not split evenly over {world} processes. "
                f"HINT: use a multiple of {world}."
            )

    PROGRESS_BAR_METRICS: tuple[str, ...] = ("sft/loss", "timing_s/step")

    def training_step(self, batch: Batch) -> None:  # type: ignore[override]
        """One supervised step over ``batch`` on every rank. Runs on: the controller (rank 0)."""
        started = time.perf_counter()
        metrics = self.actor.sft_step(batch)
        metrics["timing_s/step"] = time.perf_counter() - started
        self.log_dict({k: metrics.pop(k) for k in self.PROGRESS_BAR_METRICS if k in metrics}, prog_bar=True)
        self.log_dict(metrics)

    def validation_step(self, batch: Batch, batch_idx: int = 0) -> None:  # type: ignore[override]
        """Log ``val/loss`` of a validation batch, weighted by its loss tokens (Lightning's epoch mean is then
        the token mean of the whole validation set); a batch is padded to split over the ranks with rows of no token.

        Runs on: the controller (rank 0); the forward passes run on every rank.
        """
        world, size = self.trainer.world_size, len(batch)
        pad = -size % world
        if pad:
            batch = batch.select(torch.cat([torch.arange(size), torch.zeros(pad, dtype=torch.long)]))
            batch["loss_mask"][size:] = 0
        out = self.actor.sft_loss(batch)  # averaged over ranks: the ratio is the batch's token mean
        tokens = out["tokens"] * world
        loss = out["loss_sum"] / max(out["tokens"], 1e-9)
        self.log("val/loss", loss, batch_size=max(1, round(tokens)), on_step=False, on_epoch=True, prog_bar=True)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Nothing beyond Lightning's state (weights, optimizer, schedule, data position). Runs on: every process."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Nothing to restore beyond Lightning's state. Runs on: every process."""
