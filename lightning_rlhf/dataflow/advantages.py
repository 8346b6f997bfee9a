"""The advantage step of a dataflow (``RLHFModule.compute_advantages``, ``estimate_advantages``): token rewards
shaped from the scores, and the configured estimator over them."""

from __future__ import annotations

import torch

from lightning_rlhf.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    compute_advantages,
    kl_penalty,
    masked_mean,
    overlong_reward_penalty,
    scores_to_token_rewards,
)
from lightning_rlhf.batch import Batch, sampled_mask
from lightning_rlhf.config import AlgorithmConfig

__all__ = ["estimate", "kl_controller", "token_rewards"]


def token_rewards(
    rollout: Batch,
    metrics: dict[str, float],
    *,
    algo: AlgorithmConfig,
    max_new_tokens: int,
    kl_controller: AdaptiveKLController | FixedKLController,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_rewards, mask)`` of a scored ``rollout``: the score at the last sampled token (plus the overlong
    penalty), minus the KL penalty when it is in the reward (which updates ``kl_controller``); with
    ``mask_truncated``, the rollout's ``loss_mask`` leaves truncated samples out. Runs on: controller."""
    mask = sampled_mask(rollout)
    scores = rollout["scores"].float()
    if algo.filtering.overlong_buffer:
        penalty = overlong_reward_penalty(
            mask.sum(-1),
            max_len=max_new_tokens,
            buffer=algo.filtering.overlong_buffer,
            penalty=algo.filtering.overlong_penalty,
        )
        scores = scores + penalty
        metrics["critic/overlong_penalty/mean"] = float(penalty.mean())
    rewards = scores_to_token_rewards(scores, mask)
    if algo.kl.in_reward and algo.kl.coef > 0:
        kl = kl_penalty(rollout["old_logprobs"], rollout["ref_logprobs"], estimator=algo.kl.estimator)
        coef = kl_controller.value
        rewards = rewards - coef * kl * mask
        metrics["actor/reward_kl_penalty"] = current_kl = float(masked_mean(kl, mask))
        metrics["actor/reward_kl_coef"] = coef
        kl_controller.update(current_kl, n_steps=len(rollout))
    if algo.filtering.mask_truncated:
        rollout["loss_mask"] = mask * (~rollout["response_truncated"]).to(mask.dtype)[:, None]
    return rewards, mask


def estimate(
    algo: AlgorithmConfig,
    rollout: Batch,
    rewards: torch.Tensor,
    *,
    values: str,
    baselines: str,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` with ``algo.advantage``; see ``RLHFModule.estimate_advantages``. Runs on:
    controller."""
    return compute_advantages(
        algo.advantage,
        token_rewards=rewards,
        response_mask=sampled_mask(rollout) if mask is None else mask,
        values=rollout.tensors.get(values),
        group_ids=rollout["uid"],
        baselines=rollout.tensors.get(baselines),
        gamma=algo.gamma,
        lam=algo.lam,
        norm_by_std=algo.norm_adv_by_std,
        eps=algo.adv_eps,
    )


def kl_controller(algo: AlgorithmConfig) -> AdaptiveKLController | FixedKLController:
    """The KL coefficient's controller of ``algo``: adaptive with a ``kl_target``, else fixed. Runs on: every
    process (the module's constructor)."""
    if algo.kl.target is not None:
        return AdaptiveKLController(init_kl_coef=algo.kl.coef, target_kl=algo.kl.target, horizon=algo.kl.horizon)
    return FixedKLController(kl_coef=algo.kl.coef)
