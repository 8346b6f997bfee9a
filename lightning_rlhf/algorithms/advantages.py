"""Advantage estimators (GAE for PPO, group-relative for GRPO).

Every estimator shares one signature so a trainer can switch by name::

    advantages, returns = compute_advantages("grpo", token_rewards=r, response_mask=m, group_ids=g)
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_rlhf.algorithms.functional import masked_whiten
from lightning_rlhf.algorithms.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "compute_advantages",
    "gae_advantages",
    "grpo_advantages",
]


class AdvantageEstimator(Protocol):
    """Signature shared by all registered advantage estimators."""

    def __call__(
        self,
        token_rewards: Tensor,
        response_mask: Tensor,
        *,
        values: Tensor | None = None,
        group_ids: Tensor | None = None,
        gamma: float = 1.0,
        lam: float = 1.0,
        norm_by_std: bool = True,
        eps: float = 1e-6,
    ) -> tuple[Tensor, Tensor]: ...


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def _float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.float()


@ADVANTAGE_ESTIMATORS.register("gae")
def gae_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Tensor | None = None,
    group_ids: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016), computed backwards over time.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``, where
    ``t + 1`` is the next *valid* token: masked-out positions are skipped (contribute nothing), and the
    last valid token has next value ``0``. ``returns = A + V`` before whitening; the advantages are then
    whitened over valid tokens (``masked_whiten``). Computed without gradient.

    Runs on: controller or worker (pure function).

    Args:
        token_rewards: ``[B, T]`` per-token rewards.
        response_mask: ``[B, T]`` binary mask of valid response tokens.
        values: ``[B, T]`` value estimates (required).
        group_ids: Unused.
        gamma: Discount factor.
        lam: GAE lambda.
        norm_by_std: Unused (GAE advantages are always whitened).
        eps: Unused (whitening uses its own ``1e-8``).

    Returns:
        ``(advantages [B, T], returns [B, T])``, both zero where ``response_mask`` is 0.

    Raises:
        ValueError: If ``values`` is ``None``.
    """
    del group_ids, norm_by_std, eps
    if values is None:
        raise ValueError("Advantage estimator 'gae' requires `values` ([B, T] critic values).")
    with torch.no_grad():
        mask = response_mask.bool()
        rewards = _float(token_rewards)
        vals = values.to(rewards.dtype)
        zero_row = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
        next_value, next_adv = zero_row, zero_row
        advs = torch.zeros_like(rewards)
        for t in range(rewards.shape[-1] - 1, -1, -1):
            m_t = mask[:, t]
            delta = rewards[:, t] + gamma * next_value - vals[:, t]
            adv_t = delta + gamma * lam * next_adv
            advs[:, t] = torch.where(m_t, adv_t, zero_row)
            # Padding is transparent: carry the successor's value/advantage through it.
            next_value = torch.where(m_t, vals[:, t], next_value)
            next_adv = torch.where(m_t, adv_t, next_adv)
        zeros = torch.zeros_like(advs)
        returns = torch.where(mask, advs + vals, zeros)
        advantages = torch.where(mask, masked_whiten(advs, mask), zeros)
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Tensor | None = None,
    group_ids: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Group-relative advantages (GRPO, Shao et al., 2024), outcome supervision.

    Each sequence's score is its masked reward sum; the advantage is ``(score - mean_g) / (std_g + eps)``
    (or ``score - mean_g`` without ``norm_by_std``) with the mean and unbiased std of its group ``g``.
    A group of size 1 uses mean 0 and std 1, i.e. its advantage is its score. The advantage is
    broadcast to all valid tokens. Vectorised with ``index_add_``; computed without gradient.

    Runs on: controller or worker (pure function).

    Args:
        token_rewards: ``[B, T]`` per-token rewards (usually the score on the last token).
        response_mask: ``[B, T]`` binary mask of valid response tokens.
        values: Unused.
        group_ids: ``[B]`` integer group id per sequence (required; any integer values).
        gamma: Unused.
        lam: Unused.
        norm_by_std: Divide by the group std.
        eps: Added to the std.

    Returns:
        ``(advantages [B, T], returns [B, T])``; ``returns`` equals ``advantages``; zero where the
        mask is 0.

    Raises:
        ValueError: If ``group_ids`` is ``None``.
    """
    del values, gamma, lam
    if group_ids is None:
        raise ValueError("Advantage estimator 'grpo' requires `group_ids` ([B] integer group per sequence).")
    with torch.no_grad():
        mask = response_mask.bool()
        rewards = _float(token_rewards)
        zeros = torch.zeros_like(rewards)
        scores = torch.where(mask, rewards, zeros).sum(dim=-1)  # [B]
        uniq, inverse = torch.unique(group_ids.reshape(-1), return_inverse=True)  # inverse: [B] in [0, G)
        num_groups = uniq.numel()
        counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device)
        counts.index_add_(0, inverse, torch.ones_like(scores))
        sums = torch.zeros_like(counts).index_add_(0, inverse, scores)
        group_mean = sums / counts.clamp_min(1)
        sq_dev = (scores - group_mean[inverse]) ** 2
        group_ss = torch.zeros_like(counts).index_add_(0, inverse, sq_dev)
        group_std = torch.sqrt(group_ss / (counts - 1).clamp_min(1))
        is_group = (counts > 1)[inverse]  # [B]
        mean = torch.where(is_group, group_mean[inverse], torch.zeros_like(scores))
        centred = scores - mean
        if norm_by_std:
            denom = torch.where(is_group, group_std[inverse] + eps, torch.ones_like(scores))
            centred = centred / denom
        advantages = torch.where(mask, centred.unsqueeze(-1).expand_as(rewards), zeros)
    return advantages, advantages.clone()


def compute_advantages(name: str, **kwargs: Any) -> tuple[Tensor, Tensor]:
    """Runs the advantage estimator registered as ``name``.

    Runs on: controller or worker (pure function).

    Args:
        name: Registered estimator name (see ``ADVANTAGE_ESTIMATORS.names()``).
        **kwargs: Arguments of the estimator (``token_rewards``, ``response_mask``, ...).

    Returns:
        ``(advantages [B, T], returns [B, T])``.

    Raises:
        ValueError: If ``name`` is unknown or required inputs are missing.
    """
    return ADVANTAGE_ESTIMATORS.get(name)(**kwargs)
