"""The reference: a frozen copy of the initial policy, for the KL term; and the teacher, a frozen model of another
size whose log-probs of the student's tokens are on-policy distillation's signal."""

from __future__ import annotations

from typing import Any

import torch

from lightning_rlhf.batch import Batch
from lightning_rlhf.controller.dispatch import Dispatch, role_method
from lightning_rlhf.engines.rollout.base import logprob_temperature
from lightning_rlhf.engines.train import RESPONSE_INPUTS, forward_response
from lightning_rlhf.roles.base import Role, load_model

__all__ = ["ReferenceRole", "TeacherRole", "check_same_vocabulary"]


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
    SETTING = "ReferenceRole(path=...)"
    """What errors call the role's model."""

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
        super().__init__(micro_batch_size=micro_batch_size, dtype=dtype, setting=self.SETTING)
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
            model = load_model(AutoModelForCausalLM, self.path, setting=self.SETTING, dtype=self.dtype)
            self.set_model(model.eval().requires_grad_(False))

    @role_method(Dispatch.DP_SPLIT, reads=RESPONSE_INPUTS, writes=("ref_logprobs",), sequence_parallel=True)
    def log_prob(self, batch: Batch) -> Batch:
        """Reference log-probs of the responses, as ``ref_logprobs`` ``[B, R]``. Runs on: every worker rank."""
        batch["ref_logprobs"] = self.response_logprobs(batch)
        return batch

    def response_logprobs(self, batch: Batch) -> torch.Tensor:
        """The frozen model's log-probs of ``batch``'s response tokens ``[B, R]``, at the rollout's temperature. Runs
        on: every worker rank (inside a role method)."""
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
        return out["logprobs"]


class TeacherRole(ReferenceRole):
    """A frozen teacher (on-policy distillation): loaded, sharded and placed as the reference is, its log-probs of the
    student's sampled tokens written as ``teacher_logprobs``. Its tokenizer must be the student's
    (:func:`check_same_vocabulary`). Runs on: every process; ``log_prob`` on all ranks of its pool."""

    name = "teacher"

    SETTING = "OnPolicyDistillationModule(teacher=...)"

    @role_method(Dispatch.DP_SPLIT, reads=RESPONSE_INPUTS, writes=("teacher_logprobs",), sequence_parallel=True)
    def log_prob(self, batch: Batch) -> Batch:
        """The teacher's log-probs of the responses, as ``teacher_logprobs`` ``[B, R]``. Runs on: every worker rank."""
        batch["teacher_logprobs"] = self.response_logprobs(batch)
        return batch


def check_same_vocabulary(student: Any, teacher_path: str, *, setting: str) -> None:
    """Refuse a teacher whose tokenizer maps any token to another id than the student's ``student`` tokenizer does: its
    log-probs would score other tokens than the student sampled. Runs on: every process (the module's constructor,
    before any model loads).

    Raises:
        ValueError: the vocabularies differ, naming ``setting``, both sizes and a token that differs.
    """
    from transformers import AutoTokenizer

    teacher = AutoTokenizer.from_pretrained(teacher_path)
    ours, theirs = student.get_vocab(), teacher.get_vocab()
    if ours == theirs:
        return
    token = min((set(ours.items()) ^ set(theirs.items())), key=lambda kv: kv[1])[0]
    example = f"; e.g. {token!r} is id {ours.get(token)} for the student and {theirs.get(token)} for the teacher"
    raise ValueError(
        f"{setting}={teacher_path!r}: its tokenizer has {len(theirs)} tokens and the student's {len(ours)}, not the "
        f"same ids{example}. On-policy distillation scores the student's sampled token ids with the teacher, so both "
        "must share one vocabulary. HINT: a teacher of the student's family (the same tokenizer), or RL with a reward "
        "instead."
    )
