"""GRPO: group-normalised rewards as advantages, no critic (Shao et al., 2024, DeepSeekMath)."""

from __future__ import annotations

import time
from typing import Any

from lightning_rlhf.batch import Batch
from lightning_rlhf.module import RLHFModule
from lightning_rlhf.modules.defaults import AlgorithmDefaults, critic_free

__all__ = ["GRPOModule"]


class GRPOModule(RLHFModule):
    """GRPO. Same arguments as :class:`RLHFModule`; the default algorithm is GRPO with a k3 KL loss
    (coefficient 0.001, so a reference model is loaded unless ``kl_coef=0``), merged under a passed ``algorithm``
    (:mod:`lightning_rlhf.modules.defaults`); an estimator that needs a critic or ReMax's baselines is refused.

    Runs on: every process; ``training_step`` on the controller.
    """

    ALGORITHM = AlgorithmDefaults(
        "GRPOModule",
        {"advantage": "grpo", "kl.coef": 0.001, "kl.estimator": "k3"},
        rules=(critic_free("GRPOModule"),),
    )
    """The default algorithm, and what a passed ``algorithm`` must fit; a subclass (RLOO, DAPO, ...) sets its own."""

    def __init__(self, actor: str, **kwargs: Any) -> None:
        kwargs["algorithm"] = self.ALGORITHM.resolve(kwargs.get("algorithm"), kwargs.get("rollout"))
        super().__init__(actor, **kwargs)

    ASYNC_ROLLOUTS = True

    def training_step(self, batch: Batch) -> None:  # type: ignore[override]
        """Generate n samples per prompt, then :meth:`train_on` them (asynchronous, with a rollout pool: the previous
        step's rollout, while the pool generates this one). Runs on: controller."""
        t0, metrics = time.perf_counter(), dict[str, float]()
        with self.rollouts(batch, metrics) as rollout:
            if rollout is not None:
                rollout = self.train_on(batch, rollout, metrics)
        self.log_step(rollout, metrics, started=t0)

    def train_on(self, batch: Batch, rollout: Batch, metrics: dict[str, float]) -> Batch:
        """Score ``rollout`` (dynamic sampling: keep the prompts whose samples disagree, drawing more after
        ``batch``), compute group advantages, update the actor; returns the scored rollout. Runs on: controller."""
        rollout = self.reward.score(rollout)
        if self.algorithm.filtering.dynamic_sampling:  # DAPO: only the prompts whose samples disagree, more rounds
            with self.timer("dynamic_sampling", metrics):
                rollout = self.keep_informative_groups(batch, rollout, metrics)
        # Old log-probs (else the update's own detached ones) and the reference's: one stage, on disjoint pools at once
        with self.timer("stage_score", metrics), self.concurrently():
            reads = {
                "old_log_prob": self.actor.log_prob(rollout) if self.algorithm.needs_old_logprobs else None,
                "ref": self.reference.log_prob(rollout)
                if self.reference is not None and self.algorithm.kl.coef > 0
                else None,
            }
        rollout, _ = self.collect(rollout, reads, metrics)
        rollout = self.compute_advantages(rollout, metrics)
        with self.timer("update_actor", metrics):
            metrics |= self.actor.update(rollout)
        return rollout
