"""Advantage estimators: GAE (PPO), group-relative (GRPO, RLOO, REINFORCE++-baseline), REINFORCE++, ReMax.

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
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "remax_advantages",
    "rloo_advantages",
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
        baselines: Tensor | None = None,
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
    baselines: Tensor | None = None,
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
        baselines: Unused.
        gamma: Discount factor.
        lam: GAE lambda.
        norm_by_std: Unused (GAE advantages are always whitened).
        eps: Unused (whitening uses its own ``1e-8``).

    Returns:
        ``(advantages [B, T], returns [B, T])``, both zero where ``response_mask`` is 0.

    Raises:
        ValueError: If ``values`` is ``None``.
    """
    del group_ids, baselines, norm_by_std, eps
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
    baselines: Tensor | None = None,
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

    Dr.GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training") needs no estimator of its own: it
    is this estimator with ``norm_by_std=False`` together with the ``"seq-mean-token-sum-norm"`` loss
    aggregation (see ``LOSS_AGGREGATIONS``).

    Runs on: controller or worker (pure function).

    Args:
        token_rewards: ``[B, T]`` per-token rewards (usually the score on the last token).
        response_mask: ``[B, T]`` binary mask of valid response tokens.
        values: Unused.
        group_ids: ``[B]`` integer group id per sequence (required; any integer values).
        baselines: Unused.
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
    del values, baselines, gamma, lam
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


def _sequence_scores(rewards: Tensor, mask: Tensor) -> Tensor:
    """``[B]`` masked sum of ``[B, T]`` token rewards (padding ignored, even if ``nan``)."""
    return torch.where(mask, rewards, torch.zeros_like(rewards)).sum(dim=-1)


def _group_sum_count(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """For each sequence, the sum of its group's ``[B]`` scores and its group's size, both ``[B]``."""
    uniq, inverse = torch.unique(group_ids.reshape(-1), return_inverse=True)  # inverse: [B] in [0, G)
    counts = torch.zeros(uniq.numel(), dtype=scores.dtype, device=scores.device)
    counts.index_add_(0, inverse, torch.ones_like(scores))
    sums = torch.zeros_like(counts).index_add_(0, inverse, scores)
    return sums[inverse], counts[inverse]


def _broadcast(per_seq: Tensor, mask: Tensor) -> Tensor:
    """Spreads a ``[B]`` value over the valid tokens of a ``[B, T]`` mask (zeros on padding)."""
    expanded = per_seq.unsqueeze(-1).expand(mask.shape)
    return torch.where(mask, expanded, torch.zeros_like(expanded))


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Tensor | None = None,
    group_ids: Tensor | None = None,
    baselines: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """REINFORCE Leave-One-Out advantages (RLOO; Ahmadian et al., 2024, "Back to Basics: Revisiting
    REINFORCE Style Optimization for Learning from Human Feedback in LLMs").

    Each sequence's score ``s_i`` is its masked reward sum. With ``k`` samples in its group, the baseline
    is the mean score of the *other* ``k - 1`` samples: ``A_i = s_i - (sum_g - s_i) / (k - 1)``
    (equivalently ``k / (k - 1) * (s_i - mean_g)``). A group of size 1 has no other sample, hence no
    baseline, and gets advantage ``0`` (it contributes no gradient). No std normalisation. The advantage
    is broadcast to all valid tokens. Computed without gradient.

    Runs on: controller or worker (pure function).

    Args:
        token_rewards: ``[B, T]`` per-token rewards (usually the score on the last token).
        response_mask: ``[B, T]`` binary mask of valid response tokens.
        values: Unused.
        group_ids: ``[B]`` integer group id per sequence (required; any integer values).
        baselines: Unused.
        gamma: Unused.
        lam: Unused.
        norm_by_std: Unused.
        eps: Unused.

    Returns:
        ``(advantages [B, T], returns [B, T])``; ``returns`` equals ``advantages``; zero where the
        mask is 0.

    Raises:
        ValueError: If ``group_ids`` is ``None``.
    """
    del values, baselines, gamma, lam, norm_by_std, eps
    if group_ids is None:
        raise ValueError("Advantage estimator 'rloo' requires `group_ids` ([B] integer group per sequence).")
    with torch.no_grad():
        mask = response_mask.bool()
        scores = _sequence_scores(_float(token_rewards), mask)  # [B]
        group_sum, count = _group_sum_count(scores, group_ids)
        loo_mean = (group_sum - scores) / (count - 1).clamp_min(1)
        per_seq = torch.where(count > 1, scores - loo_mean, torch.zeros_like(scores))
        advantages = _broadcast(per_seq, mask)
    return advantages, advantages.clone()


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Tensor | None = None,
    group_ids: Tensor | None = None,
    baselines: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ advantages (Hu, 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning
    Large Language Models"): critic-free discounted returns, normalised over the whole batch.

    ``G_t = r_t + gamma * G_{t+1}`` computed backwards, where ``t + 1`` is the next *valid* token
    (masked-out positions are skipped and contribute nothing; the last valid token has ``G_{t+1} = 0``).
    ``token_rewards`` are used as given, so they should already contain any per-token KL penalty. The
    advantages are ``G`` whitened with the mean and unbiased std of all valid tokens of the batch
    (``masked_whiten``), then zeroed on padding. Computed without gradient.

    Runs on: controller or worker (pure function).

    Args:
        token_rewards: ``[B, T]`` per-token rewards (score on the last token, minus any KL penalty).
        response_mask: ``[B, T]`` binary mask of valid response tokens.
        values: Unused.
        group_ids: Unused.
        baselines: Unused.
        gamma: Discount factor.
        lam: Unused.
        norm_by_std: Unused (the advantages are always whitened).
        eps: Unused (whitening uses its own ``1e-8``).

    Returns:
        ``(advantages [B, T], returns [B, T])``: whitened advantages and the un-whitened discounted
        returns ``G``; both zero where the mask is 0.
    """
    del values, group_ids, baselines, lam, norm_by_std, eps
    with torch.no_grad():
        mask = response_mask.bool()
        rewards = _float(token_rewards)
        zero_row = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
        running = zero_row
        returns = torch.zeros_like(rewards)
        for t in range(rewards.shape[-1] - 1, -1, -1):
            m_t = mask[:, t]
            ret_t = rewards[:, t] + gamma * running
            returns[:, t] = torch.where(m_t, ret_t, zero_row)
            running = torch.where(m_t, ret_t, running)  # padding is transparent
        advantages = torch.where(mask, masked_whiten(returns, mask), torch.zeros_like(returns))
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Tensor | None = None,
    group_ids: Tensor | None = None,
    baselines: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline advantages (Hu, 2025, "REINFORCE++: A Simple and Efficient Approach for
    Aligning Large Language Models"): group-mean baseline, then batch-level normalisation.

    Each sequence's score is its masked reward sum; its group's mean score is subtracted (no division
    by the group std) and the result is broadcast to all valid tokens. As in ``"grpo"``, a group of size
    1 uses mean 0, i.e. its centred score is its score. The advantages are these centred values whitened
    with the mean and unbiased std of all valid tokens of the batch (``masked_whiten``), then zeroed on
    padding. Computed without gradient.

    Runs on: controller or worker (pure function).

    Args:
        token_rewards: ``[B, T]`` per-token rewards (usually the score on the last token).
        response_mask: ``[B, T]`` binary mask of valid response tokens.
        values: Unused.
        group_ids: ``[B]`` integer group id per sequence (required; any integer values).
        baselines: Unused.
        gamma: Unused.
        lam: Unused.
        norm_by_std: Unused (the batch-level whitening always divides by the std).
        eps: Unused (whitening uses its own ``1e-8``).

    Returns:
        ``(advantages [B, T], returns [B, T])``: whitened advantages, and as ``returns`` the group-centred
        scores *before* whitening; both zero where the mask is 0.

    Raises:
        ValueError: If ``group_ids`` is ``None``.
    """
    del values, baselines, gamma, lam, norm_by_std, eps
    if group_ids is None:
        raise ValueError(
            "Advantage estimator 'reinforce_plus_plus_baseline' requires `group_ids` ([B] integer group per sequence)."
        )
    with torch.no_grad():
        mask = response_mask.bool()
        scores = _sequence_scores(_float(token_rewards), mask)  # [B]
        group_sum, count = _group_sum_count(scores, group_ids)
        mean = torch.where(count > 1, group_sum / count, torch.zeros_like(scores))
        returns = _broadcast(scores - mean, mask)
        advantages = torch.where(mask, masked_whiten(returns, mask), torch.zeros_like(returns))
    return advantages, returns


@ADVANTAGE_ESTIMATORS.register("remax")
def remax_advantages(
    token_rewards: Tensor,
    response_mask: Tensor,
    *,
    values: Tensor | None = None,
    group_ids: Tensor | None = None,
    baselines: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """ReMax advantages (Li et al., 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement
    Learning Method for Aligning Large Language Models").

    Each sequence's score ``s_i`` is its masked reward sum; the baseline is the score ``b_i`` of the
    greedy (argmax) response to the same prompt, so ``A_i = s_i - b_i``, broadcast to all valid tokens.
    ``baselines`` is subtracted as given: score it the same way as the samples (e.g. include the same
    KL penalty if ``token_rewards`` contain one). No normalisation. Computed without gradient.

    Runs on: controller or worker (pure function).

    Args:
        token_rewards: ``[B, T]`` per-token rewards (usually the score on the last token).
        response_mask: ``[B, T]`` binary mask of valid response tokens.
        values: Unused.
        group_ids: Unused.
        baselines: ``[B]`` score of the greedy response to each sequence's prompt (required).
        gamma: Unused.
        lam: Unused.
        norm_by_std: Unused.
        eps: Unused.

    Returns:
        ``(advantages [B, T], returns [B, T])``; ``returns`` equals ``advantages``; zero where the
        mask is 0.

    Raises:
        ValueError: If ``baselines`` is ``None``.
    """
    del values, group_ids, gamma, lam, norm_by_std, eps
    if baselines is None:
        raise ValueError("Advantage estimator 'remax' requires `baselines` ([B] greedy-response score per prompt).")
    with torch.no_grad():
        mask = response_mask.bool()
        scores = _sequence_scores(_float(token_rewards), mask)  # [B]
        advantages = _broadcast(scores - baselines.to(scores.dtype).reshape(-1), mask)
    return advantages, advantages.clone()


_EXTRA_INPUTS: dict[str, frozenset[str]] = {"gae": frozenset({"values"}), "remax": frozenset({"baselines"})}


def estimator_inputs(name: str) -> frozenset[str]:
    """What advantage estimator ``name`` needs beyond rewards and group ids: ``"values"`` (a critic) for GAE,
    ``"baselines"`` (a per-prompt reference score) for ReMax; empty for the group-relative estimators.

    Runs on: any process (modules check their roles against it before any model loads).
    """
    ADVANTAGE_ESTIMATORS.get(name)
    return _EXTRA_INPUTS.get(name, frozenset())


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
