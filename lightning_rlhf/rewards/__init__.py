"""Rewards: calling reward functions safely (``runner``), rule rewards for math (``math``), and combining several
named rewards with weights (``combine``). The role that scores rollouts with them is ``roles.RewardRole``.

The names load on first use (:mod:`lightning_rlhf.lazy`): a reward worker running ``math_reward`` does not import
torch with the runner.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_rlhf.lazy import lazy_exports

if TYPE_CHECKING:
    from lightning_rlhf.rewards.combine import RewardComponent, RewardSpec, reward_components, weighted_sum
    from lightning_rlhf.rewards.math import extract_final_number, gsm8k_reward, math_reward
    from lightning_rlhf.rewards.runner import (
        RewardFn,
        RewardFunctionError,
        RewardOutcome,
        call_reward_fn,
        check_scores,
        close_reward_pools,
        reward_fn_name,
        reward_workers,
    )

__all__ = [
    "RewardComponent",
    "RewardFn",
    "RewardFunctionError",
    "RewardOutcome",
    "RewardSpec",
    "call_reward_fn",
    "check_scores",
    "close_reward_pools",
    "extract_final_number",
    "gsm8k_reward",
    "math_reward",
    "reward_components",
    "reward_fn_name",
    "reward_workers",
    "weighted_sum",
]

__getattr__, __dir__ = lazy_exports(__name__, __file__)
