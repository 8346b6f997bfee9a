"""The reference: a frozen copy of the initial policy, for the KL term."""

from __future__ import annotations

from typing import Any

import torch

from lightning_rlhf.batch import Batch
from lightning_rlhf.controller.dispatch import Dispatch, role_method
from lightning_rlhf.engines.rollout.base import logprob_temperature
from lightning_rlhf.engines.train import RESPONSE_INPUTS, forward_response
from lightning_rlhf.roles.base import Role, load_model

__all__ = ["ReferenceRole"]


class ReferenceRole(Role):
    """Frozen causal LM. Runs on: every process; ``log_prob`` runs on all ranks.

    Args:
        temperature: the rollout temperature: log-probs are taken at it, as the actor's are (at 1, the raw
            policy's, for greedy rollouts at temperature 0).
        shared_prefix: compute each group's prompt once (``AlgorithmConfig.batching.shared_prefix``).
        adapters_of: with LoRA, the actor whose base model is the reference: ``log_prob`` runs the actor's model
            with its adapters disabled, and no second model is loaded (``path`` is then the actor's).
    """

    name = "reference"

    def __init__(
        self,
        path: str,
        *,
        temperature: float,
        micro_batch_size: int,
        dtype: torch.dtype = torch.float32,
        shared_prefix: bool = True,
        adapters_of: Role | None = None,
    ) -> None:
        super().__init__(micro_batch_size=micro_batch_size, dtype=dtype, setting="ReferenceRole(path=...)")
        self.path = path
        self.temperature = logprob_temperature(temperature)
        self.shared_prefix = shared_prefix
        # Not an nn.Module attribute: the actor's weights stay the actor's in checkpoints.
        self.__dict__["adapters_of"] = adapters_of

    @property
    def base(self) -> Role | None:
        """The actor whose model, adapters off, is the reference (LoRA), or None (a model of its own)."""
        return self.__dict__["adapters_of"]

    def borrows_model(self) -> Role | None:
        """The actor whose base (adapters off) is the reference, or None. Runs on: every process."""
        return self.base

    def hold_own_model(self) -> None:
        """Load the base as a frozen model of its own: the reference is placed away from the actor's shards
        (``RLHFStrategy(placement=...)``). Runs on: every process, at set-up, before any model loads."""
        self.__dict__["adapters_of"] = None

    def load(self) -> None:
        """Load the frozen model in ``dtype`` (nothing with LoRA: the actor's base serves). Runs on: every process."""
        from transformers import AutoModelForCausalLM

        if self.model is None and self.base is None:
            model = load_model(AutoModelForCausalLM, self.path, setting="ReferenceRole(path=...)", dtype=self.dtype)
            self.set_model(model.eval().requires_grad_(False))

    @role_method(Dispatch.DP_SPLIT, reads=RESPONSE_INPUTS, writes=("ref_logprobs",), sequence_parallel=True)
    def log_prob(self, batch: Batch) -> Batch:
        """Reference log-probs of the responses, as ``ref_logprobs`` ``[B, R]``. Runs on: every worker rank."""
        temperature = self.temperature
        group = int(batch.meta.get("group_size", 1)) if self.shared_prefix else 1
        kernels = self.train_engine.layer.token_kernels()  # the device layer's (the CPU's compiled ones)

        def logprobs(model: torch.nn.Module, micro: Batch) -> dict[str, torch.Tensor]:
            return forward_response(
                model, micro, output="logprobs", temperature=temperature, group_size=group, kernels=kernels
            )

        if self.base is None:
            out = self.train_engine.infer(batch, logprobs)
        else:
            adapted: Any = self.base.model
            with adapted.disable_adapter():  # peft: the base model's forward, the same shards
                out = self.base.train_engine.infer(batch, logprobs)
        batch["ref_logprobs"] = out["logprobs"]
        return batch
