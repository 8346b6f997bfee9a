"""Safe-RLHF (Dai et al., 2024): maximise the reward subject to ``E[cost] <= cost_limit`` (PPO-Lagrangian), with an
extra role: a cost model (or function) scores every rollout, and, with GAE, a second critic learns its values."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from lightning_rlhf.algorithms import (
    LagrangeMultiplier,
    estimator_inputs,
    lagrangian_advantages,
    scores_to_token_rewards,
)
from lightning_rlhf.batch import Batch, sampled_mask
from lightning_rlhf.config import OptimConfig, SafetyConfig
from lightning_rlhf.module import RLHFModule
from lightning_rlhf.modules.defaults import AlgorithmDefaults, Rule
from lightning_rlhf.roles import CriticRole, RewardFn, RewardRole
from lightning_rlhf.roles.base import check_pretrained

__all__ = ["SafeRLHFModule"]


class SafeRLHFModule(RLHFModule):
    """Safe-RLHF: the actor's advantage is ``(A_reward - lambda * A_cost) / (1 + lambda)``, and the Lagrange
    multiplier ``lambda`` rises while the mean cost is over ``SafetyConfig.cost_limit`` and falls below it.

    Runs on: every process; ``training_step`` on the controller.

    Args:
        actor: the policy, as for :class:`RLHFModule`.
        cost: a cost function ``fn(prompts, completions, **columns) -> list[float]`` (higher = less safe) or
            the path of a sequence-classification cost model.
        cost_critic: value model of the cost, needed with ``advantage="gae"``; defaults to the critic's path.
        safety: the constraint and the multiplier's settings.
        cost_critic_optim: optimizer of the cost critic (defaults to the critic's).
        **kwargs: the other :class:`RLHFModule` arguments (``reward``, ``critic``, ``algorithm``, ...). Any
            critic-free estimator but ReMax (whose greedy baseline has no cost counterpart here) works too.
    """

    ALGORITHM = AlgorithmDefaults(
        "SafeRLHFModule",
        rules=(
            Rule(
                "advantage",
                lambda v, _: "baselines" not in estimator_inputs(v),
                "an estimator with a cost counterpart (ReMax's greedy baseline has none)",
                fix="use 'gae' (with critics), 'grpo', 'rloo' or 'reinforce_plus_plus'",
            ),
        ),
    )
    """``RLHFModule``'s default algorithm, and the estimators the cost can follow."""

    def __init__(
        self,
        actor: str,
        *,
        cost: RewardFn | str,
        cost_critic: str | None = None,
        safety: SafetyConfig | None = None,
        cost_critic_optim: OptimConfig | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs["algorithm"] = self.ALGORITHM.resolve(kwargs.get("algorithm"), kwargs.get("rollout"))
        super().__init__(actor, **kwargs)
        if isinstance(cost, str):
            check_pretrained(cost, setting="SafeRLHFModule(cost=...)")
        self.safety = safety or SafetyConfig()
        self.cost = RewardRole(  # called like the reward (timeout, fallback), its own components unweighted
            cost,
            tokenizer=self.tokenizer,
            micro_batch_size=self.algorithm.batching.micro_batch_size,
            key="costs",
            config=dataclasses.replace(self.reward_config, weights=None),
            dtype=self.frozen_dtype,
        )
        self.cost_critic: CriticRole | None = None
        if self.critic is not None:
            path = cost_critic or self.critic.path
            check_pretrained(path, setting="SafeRLHFModule(cost_critic=...)")
            optim = cost_critic_optim or self.critic.optim or OptimConfig(lr=1e-5)
            self.cost_critic = CriticRole(path, algorithm=self.algorithm, optim=optim, prefix="cost_")
        s = self.safety
        self.lagrange = LagrangeMultiplier(
            init=s.lambda_init, lr=s.lambda_lr, cost_limit=s.cost_limit, max_value=s.lambda_max
        )

    def training_step(self, batch: Batch) -> None:  # type: ignore[override]
        """Generate; score reward and cost; log-probs and values; advantages of both, combined with the
        multiplier; step the multiplier on the mean cost; update the critics and the actor. Runs on: controller."""
        t0, metrics = time.perf_counter(), dict[str, float]()
        with self.timer("gen", metrics):
            rollout = self.generate_rollout(batch)
        rollout = self.cost.score(self.reward.score(rollout))
        if self.algorithm.needs_old_logprobs:
            rollout = self.actor.log_prob(rollout)
        if self.reference is not None and self.algorithm.kl.coef > 0:
            rollout = self.reference.log_prob(rollout)
        if self.critic is not None and self.cost_critic is not None:
            with self.timer("values", metrics):
                rollout = self.cost_critic.values(self.critic.values(rollout))
        rollout = self.compute_advantages(rollout, metrics)  # the reward's, with the KL penalty if configured
        cost_rewards = scores_to_token_rewards(rollout["costs"].float(), sampled_mask(rollout))
        cost_advantages, rollout["cost_returns"] = self.estimate_advantages(
            rollout, cost_rewards, values="cost_values", baselines="cost_baselines"
        )
        mean_cost = float(rollout["costs"].float().mean())
        multiplier = self.lagrange.update(mean_cost)
        rollout["advantages"] = lagrangian_advantages(rollout["advantages"], cost_advantages, multiplier=multiplier)
        metrics |= {"safety/lambda": multiplier, "safety/cost/mean": mean_cost}
        metrics["safety/cost_violation"] = mean_cost - self.safety.cost_limit
        if self.critic is not None and self.cost_critic is not None:
            with self.timer("update_critic", metrics):
                metrics |= self.critic.update(rollout)
                metrics |= self.cost_critic.update(rollout)
        with self.timer("update_actor", metrics):
            metrics |= self.actor.update(rollout)
        self.log_step(rollout, metrics, started=t0)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Also save the multiplier. Runs on: every process."""
        super().on_save_checkpoint(checkpoint)
        checkpoint["lightning_rlhf"]["lagrange"] = self.lagrange.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Also restore the multiplier. Runs on: every process."""
        super().on_load_checkpoint(checkpoint)
        if "lagrange" in checkpoint.get("lightning_rlhf", {}):
            self.lagrange.load_state_dict(checkpoint["lightning_rlhf"]["lagrange"])
