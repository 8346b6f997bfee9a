"""PPO-style clipped policy/value losses and loss aggregation modes."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from lightning_rlhf.algorithms.functional import masked_mean, masked_sum
from lightning_rlhf.algorithms.registry import Registry

__all__ = [
    "LOSS_AGGREGATIONS",
    "LossAggregation",
    "aggregate_loss",
    "policy_loss_clipped",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "token_mean",
    "value_loss_clipped",
]


class LossAggregation(Protocol):
    """Signature shared by all registered loss aggregations."""

    def __call__(self, loss: Tensor, mask: Tensor, *, num_tokens: Tensor | float | None = None) -> Tensor: ...


LOSS_AGGREGATIONS: Registry[LossAggregation] = Registry("loss aggregation")


@LOSS_AGGREGATIONS.register("token-mean")
def token_mean(loss: Tensor, mask: Tensor, *, num_tokens: Tensor | float | None = None) -> Tensor:
    """Sum of valid-token losses divided by the number of tokens.

    Pass the global token count of the whole (mini-)batch as ``num_tokens`` when summing losses of
    several micro-batches / data-parallel ranks, so the result is the exact global token mean.

    Runs on: controller or worker (pure function).

    Args:
        loss: ``[B, T]`` per-token loss.
        mask: ``[B, T]`` binary mask of valid tokens.
        num_tokens: Denominator; defaults to ``mask.sum()``. Clamped to at least 1.

    Returns:
        Scalar loss.
    """
    total = masked_sum(loss, mask)
    denom = mask.bool().sum() if num_tokens is None else num_tokens
    denom_t = torch.as_tensor(denom, device=total.device).to(total.dtype).clamp_min(1.0)
    return total / denom_t


@LOSS_AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss: Tensor, mask: Tensor, *, num_tokens: Tensor | float | None = None) -> Tensor:
    """Per-sequence sum over valid tokens, then mean over all ``B`` sequences.

    Runs on: controller or worker (pure function).

    Args:
        loss: ``[B, T]`` per-token loss.
        mask: ``[B, T]`` binary mask of valid tokens.
        num_tokens: Ignored (accepted for a uniform signature).

    Returns:
        Scalar loss (``0`` if ``B == 0``).
    """
    del num_tokens
    seq_losses = masked_sum(loss, mask, dim=-1)  # [B]
    return seq_losses.sum() / max(seq_losses.shape[0], 1)


@LOSS_AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: Tensor, mask: Tensor, *, num_tokens: Tensor | float | None = None) -> Tensor:
    """Per-sequence mean over valid tokens, then mean over sequences with a non-empty mask.

    Runs on: controller or worker (pure function).

    Args:
        loss: ``[B, T]`` per-token loss.
        mask: ``[B, T]`` binary mask of valid tokens.
        num_tokens: Ignored (accepted for a uniform signature).

    Returns:
        Scalar loss (``0`` if every mask row is empty).
    """
    del num_tokens
    seq_means = masked_mean(loss, mask, dim=-1)  # [B]
    non_empty = mask.bool().any(dim=-1)  # [B]
    return masked_mean(seq_means, non_empty)


def aggregate_loss(
    loss: Tensor, mask: Tensor, *, mode: str = "token-mean", num_tokens: Tensor | float | None = None
) -> Tensor:
    """Reduces a per-token loss to a scalar with the aggregation registered as ``mode``.

    Runs on: controller or worker (pure function).

    Args:
        loss: ``[B, T]`` per-token loss.
        mask: ``[B, T]`` binary mask of valid tokens.
        mode: One of ``LOSS_AGGREGATIONS.names()``.
        num_tokens: Optional global token count (used by ``"token-mean"``).

    Returns:
        Scalar loss.

    Raises:
        ValueError: If ``mode`` is unknown.
    """
    return LOSS_AGGREGATIONS.get(mode)(loss, mask, num_tokens=num_tokens)


def policy_loss_clipped(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    agg: str = "token-mean",
    num_tokens: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate objective (Schulman et al., 2017), with asymmetric clip range.

    ``ratio = exp(clamp(logprobs - old_logprobs, -20, 20))`` and the per-token loss is
    ``max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high))``.

    Runs on: controller or worker (pure function).

    Args:
        logprobs: ``[B, T]`` current policy log-probabilities (requires grad).
        old_logprobs: ``[B, T]`` log-probabilities of the behaviour policy.
        advantages: ``[B, T]`` advantages.
        response_mask: ``[B, T]`` binary mask of valid response tokens.
        clip_low: Lower clip ``epsilon`` (ratio >= ``1 - clip_low``).
        clip_high: Upper clip ``epsilon`` (ratio <= ``1 + clip_high``).
        agg: Loss aggregation mode (see ``LOSS_AGGREGATIONS``).
        num_tokens: Optional global token count for ``"token-mean"``.

    Returns:
        ``(loss, metrics)``: differentiable scalar loss and detached scalar metrics
        ``"pg_clipfrac"`` (fraction of valid tokens where the clipped branch is strictly larger) and
        ``"ppo_kl"`` (masked mean of ``old_logprobs - logprobs``).
    """
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(unclipped, clipped)
    loss = aggregate_loss(per_token, response_mask, mode=agg, num_tokens=num_tokens)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((clipped > unclipped).to(per_token.dtype), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, metrics


def value_loss_clipped(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    clip: float = 0.2,
    agg: str = "token-mean",
    num_tokens: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value-function loss as in PPO implementations.

    ``v_clipped = old_values + clamp(values - old_values, -clip, clip)`` and the per-token loss is
    ``0.5 * max((values - returns) ** 2, (v_clipped - returns) ** 2)``.

    Runs on: controller or worker (pure function).

    Args:
        values: ``[B, T]`` current critic values (requires grad).
        old_values: ``[B, T]`` critic values at rollout time.
        returns: ``[B, T]`` value targets.
        response_mask: ``[B, T]`` binary mask of valid response tokens.
        clip: Clip range for the value update.
        agg: Loss aggregation mode (see ``LOSS_AGGREGATIONS``).
        num_tokens: Optional global token count for ``"token-mean"``.

    Returns:
        ``(loss, metrics)``: differentiable scalar loss and detached scalar metric ``"vf_clipfrac"``
        (fraction of valid tokens where the clipped loss is strictly larger).
    """
    v_clipped = old_values + (values - old_values).clamp(-clip, clip)
    unclipped = (values - returns) ** 2
    clipped = (v_clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped, clipped)
    loss = aggregate_loss(per_token, response_mask, mode=agg, num_tokens=num_tokens)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean((clipped > unclipped).to(per_token.dtype), response_mask)}
    return loss, metrics
