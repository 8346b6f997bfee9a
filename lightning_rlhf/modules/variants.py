"""Critic-free algorithms that share GRPO's dataflow and differ only in settings (registered math parts)."""

from __future__ import annotations

from typing import Any

from lightning_rlhf.config import AlgorithmConfig, RolloutConfig
from lightning_rlhf.modules.grpo import GRPOModule

__all__ = ["DAPOModule", "DrGRPOModule", "REINFORCEPPModule", "RLOOModule"]


class RLOOModule(GRPOModule):
    """RLOO (Ahmadian et al., 2024): each sample's baseline is the mean reward of the other samples of its
    prompt. GRPO's dataflow with ``advantage="rloo"``; no KL by default. Runs on: every process."""

    def __init__(self, actor: str, **kwargs: Any) -> None:
        kwargs["algorithm"] = kwargs.get("algorithm") or AlgorithmConfig(advantage="rloo")
        super().__init__(actor, **kwargs)


class REINFORCEPPModule(GRPOModule):
    """REINFORCE++ (Hu, 2025): token-level KL penalty in the reward, returns whitened over the whole batch,
    PPO's clipped loss, no critic. Runs on: every process."""

    def __init__(self, actor: str, **kwargs: Any) -> None:
        kwargs["algorithm"] = kwargs.get("algorithm") or AlgorithmConfig(
            advantage="reinforce_plus_plus", kl_coef=0.01, kl_in_reward=True, kl_estimator="k2"
        )
        super().__init__(actor, **kwargs)


class DrGRPOModule(GRPOModule):
    """Dr.GRPO (Liu et al., 2025): GRPO without the std normalisation and with token sums divided by a constant
    length, removing GRPO's length and difficulty biases. Runs on: every process."""

    def __init__(self, actor: str, **kwargs: Any) -> None:
        kwargs["algorithm"] = kwargs.get("algorithm") or AlgorithmConfig(
            advantage="grpo", norm_adv_by_std=False, loss_agg="seq-mean-token-sum-norm"
        )
        super().__init__(actor, **kwargs)


class DAPOModule(GRPOModule):
    """DAPO (Yu et al., 2025): GRPO with clip-higher (``clip_ratio_high=0.28``), dynamic sampling (prompts whose
    samples all score the same are replaced), token-mean loss, soft overlong punishment over the last quarter
    of ``max_new_tokens``, and no KL term. Runs on: every process."""

    def __init__(self, actor: str, **kwargs: Any) -> None:
        rollout = kwargs["rollout"] = kwargs.get("rollout") or RolloutConfig(n=16)
        kwargs["algorithm"] = kwargs.get("algorithm") or AlgorithmConfig(
            advantage="grpo",
            clip_ratio_low=0.2,
            clip_ratio_high=0.28,
            loss_agg="token-mean",
            dynamic_sampling=True,
            overlong_buffer=max(1, rollout.max_new_tokens // 4),
            kl_coef=0.0,
        )
        super().__init__(actor, **kwargs)
