"""PPO with a critic and GAE (Ouyang et al., 2022; Schulman et al., 2017)."""

from __future__ import annotations

import time
from typing import Any

from lightning_rlhf.algorithms import estimator_inputs
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import RolloutConfig
from lightning_rlhf.module import RLHFModule
from lightning_rlhf.modules.defaults import AlgorithmDefaults, Rule

__all__ = ["PPOModule"]


class PPOModule(RLHFModule):
    """PPO: GAE advantages from a learned critic, KL to the reference as a per-token reward penalty.

    Same arguments as :class:`RLHFModule`; ``critic`` is required.
    Runs on: every process; ``training_step`` on the controller.
    """

    ALGORITHM = AlgorithmDefaults(
        "PPOModule",
        {"advantage": "gae", "kl.in_reward": True, "kl.estimator": "k1"},
        rules=(
            Rule(
                "advantage",
                lambda v, _: "values" in estimator_inputs(v),
                "an estimator of the critic's values ('gae')",
                fix="leave advantage unset, or use GRPOModule for critic-free advantages",
            ),
        ),
    )
    """The default algorithm; a passed ``algorithm`` is merged over it (:mod:`lightning_rlhf.modules.defaults`)."""

    def __init__(self, actor: str, **kwargs: Any) -> None:
        kwargs["rollout"] = kwargs.get("rollout") or RolloutConfig(n=1)
        kwargs["algorithm"] = self.ALGORITHM.resolve(kwargs.get("algorithm"), kwargs["rollout"])
        if kwargs.get("critic") is None:
            raise ValueError("PPOModule needs a value model: pass critic=<path> (often the actor's own path).")
        super().__init__(actor, **kwargs)

    ASYNC_ROLLOUTS = True

    def training_step(self, batch: Batch) -> None:  # type: ignore[override]
        """Generate, then :meth:`train_on` the rollout (asynchronous, with a rollout pool: the previous step's,
        while the pool generates this one). Runs on: controller."""
        t0, metrics = time.perf_counter(), dict[str, float]()
        with self.rollouts(batch, metrics) as rollout:
            if rollout is not None:
                rollout = self.train_on(rollout, metrics)
        self.log_step(rollout, metrics, started=t0)

    def train_on(self, rollout: Batch, metrics: dict[str, float]) -> Batch:
        """Score, reference and old log-probs and values (one stage), GAE, then the critic's and actor's updates (one
        stage) on ``rollout``; a stage's calls run at the same time where their roles are on disjoint rank pools
        (``RLHFStrategy(placement=...)``). Returns the rollout scored. Runs on: controller."""
        assert self.critic is not None
        with self.timer("stage_score", metrics), self.concurrently():
            reads = {
                "reward": self.reward.score(rollout),
                "old_log_prob": self.actor.log_prob(rollout),
                "ref": self.reference.log_prob(rollout)
                if self.reference is not None and self.algorithm.kl.coef > 0
                else None,
                "values": self.critic.values(rollout),
            }
        rollout, _ = self.collect(rollout, reads, metrics)
        rollout = self.compute_advantages(rollout, metrics)
        with self.timer("stage_update", metrics), self.concurrently():
            updates = {"update_critic": self.critic.update(rollout), "update_actor": self.actor.update(rollout)}
        _, update_metrics = self.collect(rollout, updates, metrics)
        metrics |= update_metrics
        return rollout
