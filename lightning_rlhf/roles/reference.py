"""The reference: a frozen copy of the initial policy, for the KL term."""

from __future__ import annotations

import torch

from lightning_rlhf.batch import Batch
from lightning_rlhf.engines.rollout.base import logprob_temperature
from lightning_rlhf.engines.train import forward_response
from lightning_rlhf.models import resolve_model_path
from lightning_rlhf.roles.base import Role, disable_dropout
from lightning_rlhf.strategy.dispatch import Dispatch, role_method

__all__ = ["ReferenceRole"]


class ReferenceRole(Role):
    """Frozen causal LM. Runs on: every process; ``log_prob`` runs on all ranks.

    Args:
        path: local folder or hub id (normally the actor's initial checkpoint).
        temperature: the rollout temperature: log-probs are taken at it, as the actor's are (at 1, the raw
            policy's, for greedy rollouts at temperature 0).
        micro_batch_size: samples per forward on one rank.
    """

    name = "reference"

    def __init__(self, path: str, *, temperature: float, micro_batch_size: int) -> None:
        super().__init__()
        self.path = path
        self.temperature = logprob_temperature(temperature)
        self.micro_batch_size = micro_batch_size

    def load(self) -> None:
        """Load the frozen model (every rank, full weights, before sharding)."""
        from transformers import AutoModelForCausalLM

        if self.model is None:
            path = resolve_model_path(self.path, setting="ReferenceRole(path=...)")
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            disable_dropout(model)
            self.model = model.eval().requires_grad_(False)

    @role_method(Dispatch.DP_SPLIT)
    def log_prob(self, batch: Batch) -> Batch:
        """Reference log-probs of the responses, as ``ref_logprobs`` ``[B, R]``. Runs on: every worker rank."""
        assert self.model is not None
        parts = []
        with torch.no_grad():
            for micro in batch.split(self.micro_batch_size):
                out = forward_response(self.model, micro, output="logprobs", temperature=self.temperature)
                parts.append(out["logprobs"].cpu())
        batch["ref_logprobs"] = torch.cat(parts)
        return batch
