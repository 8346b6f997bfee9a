"""The critic: a value model (causal-LM backbone + scalar head) trained on the returns."""

from __future__ import annotations

import torch

from lightning_rlhf.algorithms import value_loss_clipped
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import AlgorithmConfig, OptimConfig
from lightning_rlhf.engines.train import forward_response
from lightning_rlhf.models import resolve_model_path
from lightning_rlhf.roles.base import Role, disable_dropout
from lightning_rlhf.roles.training import MetricAccumulator, global_token_count, minibatches, world
from lightning_rlhf.strategy.dispatch import Dispatch, role_method

__all__ = ["CriticRole"]


class CriticRole(Role):
    """Value model loaded as ``AutoModelForTokenClassification(num_labels=1)`` from a causal-LM checkpoint
    (the backbone's weights are reused, the one-output head starts fresh), as TRL and verl do.

    Runs on: every process; its methods run on all ranks.

    Args:
        path: local folder or hub id (usually the actor's initial checkpoint or a reward model).
        algorithm: value-clip and batch splitting settings.
        optim: optimizer settings (critics usually take a higher learning rate than the actor).
        prefix: prefix of the columns it writes and trains on (``values``, ``returns``); a second critic, e.g.
            Safe-RLHF's cost critic, uses ``prefix="cost_"`` (``cost_values``, ``cost_returns``).
    """

    name = "critic"

    def __init__(self, path: str, *, algorithm: AlgorithmConfig, optim: OptimConfig, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix
        self.path = path
        self.algorithm = algorithm
        self.optim = optim

    @property
    def trainable(self) -> bool:
        return True

    def load(self) -> None:
        """Load the value model (every rank, full weights, before sharding)."""
        from transformers import AutoModelForTokenClassification

        if self.model is None:
            path = resolve_model_path(self.path, setting="CriticRole(path=...)")
            self.model = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
            disable_dropout(self.model)
            self.model.train()  # from_pretrained returns eval mode; dropout is off anyway

    @role_method(Dispatch.DP_SPLIT)
    def values(self, batch: Batch) -> Batch:
        """Per-token values of the responses, as ``<prefix>values`` ``[B, R]``. Runs on: every worker rank."""
        assert self.model is not None
        parts = []
        with torch.no_grad():
            for micro in batch.split(self.algorithm.micro_batch_size):
                parts.append(forward_response(self.model, micro, output="values")["values"].cpu())
        batch[f"{self.prefix}values"] = torch.cat(parts)
        return batch

    @role_method(Dispatch.DP_SPLIT)
    def update(self, batch: Batch) -> dict[str, float]:
        """Clipped value regression on ``<prefix>returns`` over epochs and mini-batches; metrics are named after the
        role (``critic/vf_loss``, ``cost_critic/vf_loss``). Runs on: every worker rank."""
        assert self.model is not None
        algo = self.algorithm
        device = next(self.model.parameters()).device
        mini_size = algo.mini_batch_size or len(batch) * world()[1]
        acc = MetricAccumulator()
        self.model.train()
        for mini in minibatches(batch, mini_batch_size=mini_size, epochs=algo.ppo_epochs):
            token_mean = algo.loss_agg == "token-mean"
            num_tokens = global_token_count(mini["response_mask"]) / world()[1] if token_mean else None
            for micro in mini.split(algo.micro_batch_size):
                values = forward_response(self.model, micro, output="values")["values"]
                mask = micro["response_mask"].to(device)
                loss, metrics = value_loss_clipped(
                    values,
                    micro[f"{self.prefix}values"].to(device),
                    micro[f"{self.prefix}returns"].to(device),
                    mask,
                    clip=algo.value_clip,
                    agg=algo.loss_agg,
                    num_tokens=num_tokens,
                )
                (loss if token_mean else loss * len(micro) / len(mini)).backward()
                local = mask.sum().clamp(min=1) / num_tokens if num_tokens is not None else torch.tensor(1.0)
                acc.add({"vf_loss": loss.detach() / local, **metrics})
            grad_norm, _ = self.step_optimizer()
            acc.add({"grad_norm": grad_norm})
        assert self.scheduler is not None
        self.scheduler.step()
        return acc.result(self.name)
