"""Rewards: calling reward functions safely (``runner``), rule rewards for math (``math``), and combining several
named rewards with weights (``combine``). The role that scores rollouts with them is ``roles.RewardRole``."""

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
