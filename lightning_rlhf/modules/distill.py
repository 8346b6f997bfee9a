"""On-policy distillation (Agarwal et al., 2024, GKD; Thinking Machines Lab, 2025): the student samples, a frozen
teacher scores every sampled token, and the per-token reverse KL is the signal, optionally mixed with a task reward's
group advantages. One more role (``teacher``) and a few lines of dataflow."""

from __future__ import annotations

import time
from typing import Any

from lightning_rlhf.algorithms import reverse_kl_advantages
from lightning_rlhf.batch import Batch, sampled_mask
from lightning_rlhf.module import RLHFModule
from lightning_rlhf.modules.defaults import AlgorithmDefaults, critic_free
from lightning_rlhf.roles import TeacherRole
from lightning_rlhf.roles.base import check_pretrained
from lightning_rlhf.roles.reference import check_same_vocabulary

__all__ = ["OnPolicyDistillationModule"]


class OnPolicyDistillationModule(RLHFModule):
    """On-policy distillation: the actor (the student) generates, the teacher's log-probs of its sampled tokens give
    each token the advantage ``distill_coef * (log pi_teacher - log pi_student)`` (the reverse KL's single-sample
    estimate, negated), plus ``reward_weight`` times the task reward's group advantages (the configured estimator,
    GRPO's by default), and the actor takes a policy-gradient step (``AlgorithmConfig.loss``).

    Runs on: every process; ``training_step`` on the controller.

    Args:
        actor: the student, as for :class:`RLHFModule`.
        teacher: the teacher's model folder or hub id: frozen, held in ``frozen_dtype``, placed like the reference
            (``RLHFStrategy(placement={..., "teacher": [...]})`` gives it a pool of its own); its tokenizer must be the
            student's.
        distill_coef: the weight of the teacher's signal (> 0).
        reward_weight: the weight of the task reward's advantages (0: distillation alone; the reward is still
            scored and logged, and validation uses it).
        **kwargs: the other :class:`RLHFModule` arguments (``reward``, ``rollout``, ``algorithm``, ...).
    """

    ALGORITHM = AlgorithmDefaults(
        "OnPolicyDistillationModule", {"advantage": "grpo"}, rules=(critic_free("OnPolicyDistillationModule"),)
    )
    """The task reward's estimator (used with ``reward_weight > 0``); no KL to a reference by default: the teacher
    anchors the student."""

    ASYNC_ROLLOUTS = True

    def __init__(
        self, actor: str, *, teacher: str, distill_coef: float = 1.0, reward_weight: float = 0.0, **kwargs: Any
    ) -> None:
        for name, value in (("distill_coef", distill_coef), ("reward_weight", reward_weight)):
            if not value >= 0:
                raise ValueError(f"OnPolicyDistillationModule({name}={value!r}) is invalid: expected a value >= 0.")
        if distill_coef == 0 and reward_weight == 0:
            raise ValueError(
                "OnPolicyDistillationModule(distill_coef=0, reward_weight=0) gives every token advantage 0: nothing "
                "would train. HINT: distill_coef=1.0 (the teacher's signal), and reward_weight > 0 to add the reward's."
            )
        kwargs["algorithm"] = self.ALGORITHM.resolve(kwargs.get("algorithm"), kwargs.get("rollout"))
        super().__init__(actor, **kwargs)
        setting = "OnPolicyDistillationModule(teacher=...)"
        teacher = check_pretrained(teacher, setting=setting)
        check_same_vocabulary(self.tokenizer, teacher, setting=setting)
        self.distill_coef, self.reward_weight = float(distill_coef), float(reward_weight)
        self.teacher = TeacherRole(
            teacher,
            temperature=self.rollout_config.temperature,
            micro_batch_size=self.algorithm.batching.micro_batch_size,
            dtype=self.frozen_dtype,
            shared_prefix=self.algorithm.batching.shared_prefix,
        )

    def training_step(self, batch: Batch) -> None:  # type: ignore[override]
        """Generate, then :meth:`distill_on` the rollout (asynchronous, with a rollout pool: the previous step's).
        Runs on: controller."""
        t0, metrics = time.perf_counter(), dict[str, float]()
        with self.rollouts(batch, metrics) as rollout:
            if rollout is not None:
                rollout = self.distill_on(rollout, metrics)
        self.log_step(rollout, metrics, started=t0)

    def distill_on(self, rollout: Batch, metrics: dict[str, float]) -> Batch:
        """Score ``rollout`` (logged; its advantages used with ``reward_weight``), the teacher's log-probs of the
        sampled tokens (and the student's old ones, when the update needs them) in one stage, the advantages, the
        actor's update; returns the rollout. Runs on: controller."""
        rollout = self.reward.score(rollout)
        with self.timer("stage_score", metrics), self.concurrently():
            reads = {
                "teacher": self.teacher.log_prob(rollout),
                "old_log_prob": self.actor.log_prob(rollout)
                if self.algorithm.needs_old_logprobs or "rollout_logprobs" not in rollout
                else None,
                "ref": self.reference.log_prob(rollout)
                if self.reference is not None and self.algorithm.kl.coef > 0
                else None,
            }
        rollout, _ = self.collect(rollout, reads, metrics)
        rollout = self.compute_advantages(rollout, metrics)  # the task reward's (and a KL penalty in it, if set)
        student = rollout["old_logprobs"] if "old_logprobs" in rollout else rollout["rollout_logprobs"]
        distilled, figures = reverse_kl_advantages(student, rollout["teacher_logprobs"], sampled_mask(rollout))
        rollout["advantages"] = self.distill_coef * distilled + self.reward_weight * rollout["advantages"]
        metrics |= {f"distill/{k}": float(v) for k, v in figures.items()}
        with self.timer("update_actor", metrics):
            metrics |= self.actor.update(rollout)
        return rollout
