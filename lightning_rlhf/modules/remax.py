"""ReMax (Li et al., 2023): REINFORCE with the reward of the greedy response as each prompt's baseline."""

from __future__ import annotations

import time
from typing import Any

from lightning_rlhf.batch import Batch
from lightning_rlhf.module import RLHFModule
from lightning_rlhf.modules.defaults import AlgorithmDefaults, equals

__all__ = ["ReMaxModule"]


class ReMaxModule(RLHFModule):
    """ReMax: one extra greedy generation per prompt gives the baseline; no critic, no groups needed.

    Same arguments as :class:`RLHFModule`. Runs on: every process; ``training_step`` on the controller.
    """

    ALGORITHM = AlgorithmDefaults(
        "ReMaxModule",
        {"advantage": "remax"},
        rules=(equals("advantage", "remax", fix="leave advantage unset, or use GRPOModule for another estimator"),),
    )
    """The default algorithm; a passed ``algorithm`` is merged over it (:mod:`lightning_rlhf.modules.defaults`)."""

    def __init__(self, actor: str, **kwargs: Any) -> None:
        kwargs["algorithm"] = self.ALGORITHM.resolve(kwargs.get("algorithm"), kwargs.get("rollout"))
        super().__init__(actor, **kwargs)

    def training_step(self, batch: Batch) -> None:  # type: ignore[override]
        """Sample, decode greedily for the baseline, score both, advantage = reward - greedy reward, update.
        Runs on: controller."""
        t0, metrics = time.perf_counter(), dict[str, float]()
        with self.timer("gen", metrics):
            rollout = self.generate_rollout(batch)
        with self.timer("gen_baseline", metrics):
            greedy = self.reward.score(self.generate_rollout(batch, greedy=True))
        rollout = self.reward.score(rollout)
        rollout["baselines"] = greedy["scores"][rollout["uid"]]  # uid = the prompt's row in `batch`
        metrics["critic/baseline_score/mean"] = float(greedy["scores"].mean())
        if self.algorithm.needs_old_logprobs:
            rollout = self.actor.log_prob(rollout)
        if self.reference is not None and self.algorithm.kl.coef > 0:
            rollout = self.reference.log_prob(rollout)
        rollout = self.compute_advantages(rollout, metrics)
        with self.timer("update_actor", metrics):
            metrics |= self.actor.update(rollout)
        self.log_step(rollout, metrics, started=t0)
