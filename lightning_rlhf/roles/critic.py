"""The critic: a value model (causal-LM backbone + scalar head) trained on the returns."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_rlhf.algorithms import MicroBatchAggregation, value_loss_clipped
from lightning_rlhf.batch import Batch, sampled_mask
from lightning_rlhf.config import AlgorithmConfig, OptimConfig
from lightning_rlhf.controller.dispatch import Dispatch, role_method
from lightning_rlhf.engines.train import RESPONSE_INPUTS, forward_response
from lightning_rlhf.roles.base import Role, load_model

__all__ = ["CriticRole"]


class CriticRole(Role):
    """Value model loaded as ``AutoModelForTokenClassification(num_labels=1)`` from a causal-LM checkpoint
    (the backbone's weights are reused, the one-output head starts fresh), as TRL and verl do.

    ``prefix``: of the columns it writes and trains on (``values``, ``returns``; Safe-RLHF's cost critic:
    ``"cost_"``). ``lora``: a ``peft.LoraConfig`` whose ``modules_to_save`` holds the value head (``score``).

    Runs on: every process; its methods run on all ranks.
    """

    name = "critic"

    def __init__(
        self, path: str, *, algorithm: AlgorithmConfig, optim: OptimConfig, prefix: str = "", lora: Any = None
    ) -> None:
        super().__init__(
            micro_batch_size=algorithm.batching.micro_batch_size, optim=optim, setting="CriticRole(path=...)", lora=lora
        )
        self.prefix = prefix
        self.path = path
        self.algorithm = algorithm

    def load(self) -> None:
        """Load the value model in float32 (the master weights). Runs on: every process."""
        from transformers import AutoModelForTokenClassification

        if self.model is None:
            model = load_model(
                AutoModelForTokenClassification,
                self.path,
                setting="CriticRole(path=...)",
                dtype=self.dtype,
                lora=self.lora,
                num_labels=1,
            )
            self.set_model(model.train())  # from_pretrained returns eval mode; dropout is off anyway

    @role_method(
        Dispatch.DP_SPLIT, reads=RESPONSE_INPUTS, writes=lambda role: (f"{role.prefix}values",), sequence_parallel=True
    )
    def values(self, batch: Batch) -> Batch:
        """Per-token values of the responses, as ``<prefix>values`` ``[B, R]``. Runs on: every worker rank."""
        out = self.train_engine.infer(batch, lambda model, micro: forward_response(model, micro, output="values"))
        batch[f"{self.prefix}values"] = out["values"]
        return batch

    @role_method(Dispatch.DP_SPLIT, sequence_parallel=True)
    def update(self, batch: Batch) -> dict[str, float]:
        """Clipped value regression on ``<prefix>returns`` over epochs and mini-batches; metrics are named after the
        role (``critic/vf_loss``, ``cost_critic/vf_loss``). Runs on: every worker rank."""
        algo = self.algorithm
        prefix = self.prefix

        def loss_fn(micro: Batch, agg: MicroBatchAggregation) -> tuple[Tensor, dict[str, Tensor]]:
            device = self.train_engine.device
            values = forward_response(self.train_engine.model, micro, output="values")["values"]  # type: ignore[arg-type]
            mask = sampled_mask(micro).to(device)
            loss, metrics = value_loss_clipped(
                values,
                micro[f"{prefix}values"].to(device),
                micro[f"{prefix}returns"].to(device),
                mask,
                clip=algo.loss.value_clip,
                agg=agg.mode,
                num_tokens=agg.num_tokens,
            )
            return loss, {"vf_loss": agg.report(loss, mask), **metrics}

        acc = self.train_engine.train(
            batch,
            loss_fn,
            aggregation=algo.loss.loss_agg,
            count_mask=sampled_mask,
            mini_batch_size=algo.batching.mini_batch_size,
            epochs=algo.batching.ppo_epochs,
        )
        self.train_engine.step_scheduler()
        return acc.result(self.name)
