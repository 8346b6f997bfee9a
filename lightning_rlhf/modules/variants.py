"""Critic-free algorithms that share GRPO's dataflow and differ only in settings: each ``ALGORITHM`` is its default
``AlgorithmConfig`` and the choices that define it (:mod:`lightning_rlhf.modules.defaults`)."""

from __future__ import annotations

from typing import Any

from lightning_rlhf.config import RolloutConfig
from lightning_rlhf.modules.defaults import AlgorithmDefaults, Rule, equals
from lightning_rlhf.modules.grpo import GRPOModule

__all__ = ["DAPOModule", "DrGRPOModule", "REINFORCEPPModule", "RLOOModule"]


class RLOOModule(GRPOModule):
    """RLOO (Ahmadian et al., 2024): each sample's baseline is the mean reward of the other samples of its
    prompt. GRPO's dataflow with ``advantage="rloo"``; no KL by default. Runs on: every process."""

    ALGORITHM = AlgorithmDefaults("RLOOModule", {"advantage": "rloo"}, rules=(equals("advantage", "rloo"),))


class REINFORCEPPModule(GRPOModule):
    """REINFORCE++ (Hu, 2025): token-level KL penalty in the reward, returns whitened over the whole batch,
    PPO's clipped loss, no critic. Runs on: every process."""

    ALGORITHM = AlgorithmDefaults(
        "REINFORCEPPModule",
        {"advantage": "reinforce_plus_plus", "kl.coef": 0.01, "kl.in_reward": True, "kl.estimator": "k2"},
        rules=(
            Rule(
                "advantage",
                lambda v, _: v in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"),
                "'reinforce_plus_plus' (or 'reinforce_plus_plus_baseline')",
            ),
        ),
    )


class DrGRPOModule(GRPOModule):
    """Dr.GRPO (Liu et al., 2025): GRPO without the std normalisation and with token sums divided by a constant
    length, removing GRPO's length and difficulty biases. Runs on: every process."""

    ALGORITHM = AlgorithmDefaults(
        "DrGRPOModule",
        {"advantage": "grpo", "norm_adv_by_std": False, "loss.loss_agg": "seq-mean-token-sum-norm"},
        rules=(equals("advantage", "grpo"), equals("loss.loss_agg", "seq-mean-token-sum-norm")),
    )


class DAPOModule(GRPOModule):
    """DAPO (Yu et al., 2025): GRPO with clip-higher (``clip_ratio_high=0.28``), dynamic sampling (prompts whose
    samples all score the same are replaced), token-mean loss, soft overlong punishment over the last quarter
    of ``max_new_tokens``, and no KL term. Runs on: every process."""

    ALGORITHM = AlgorithmDefaults(
        "DAPOModule",
        {
            "advantage": "grpo",
            "loss.clip_ratio_low": 0.2,
            "loss.clip_ratio_high": 0.28,
            "loss.loss_agg": "token-mean",
            "filtering.dynamic_sampling": True,
            "filtering.overlong_buffer": lambda rollout: max(1, rollout.max_new_tokens // 4),
            "kl.coef": 0.0,
        },
        rules=(
            equals("advantage", "grpo"),
            equals("loss.loss_agg", "token-mean"),
            Rule(
                "loss.clip_ratio_high",
                lambda v, c: v > c.loss.clip_ratio_low,
                "above loss.clip_ratio_low (clip-higher)",
            ),
        ),
    )

    def __init__(self, actor: str, **kwargs: Any) -> None:
        kwargs["rollout"] = kwargs.get("rollout") or RolloutConfig(n=16)
        super().__init__(actor, **kwargs)
