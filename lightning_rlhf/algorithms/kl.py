"""Per-token KL estimators between the policy and a reference policy.

Following Schulman's "Approximating KL divergence" note, with ``logr = logprobs - ref_logprobs`` on tokens
sampled from the policy: ``k1 = logr`` (unbiased, high variance), ``k2 = logr**2 / 2`` (biased, low
variance), ``k3 = exp(-logr) + logr - 1`` (unbiased, low variance, always >= 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from lightning_rlhf.algorithms.registry import Registry

__all__ = ["KL_ESTIMATORS", "KLEstimator", "kl_k1", "kl_k2", "kl_k3", "kl_penalty"]

KLEstimator = Callable[[Tensor, Tensor], Tensor]

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 estimator ``logprobs - ref_logprobs``.

    Runs on: controller or worker (pure function).

    Args:
        logprobs: ``[B, T]`` policy log-probabilities of the sampled tokens.
        ref_logprobs: ``[B, T]`` reference log-probabilities of the same tokens.

    Returns:
        ``[B, T]`` per-token KL estimate.
    """
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 estimator ``0.5 * (logprobs - ref_logprobs) ** 2``.

    Runs on: controller or worker (pure function).

    Args:
        logprobs: ``[B, T]`` policy log-probabilities of the sampled tokens.
        ref_logprobs: ``[B, T]`` reference log-probabilities of the same tokens.

    Returns:
        ``[B, T]`` per-token KL estimate (non-negative).
    """
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimator ``exp(r) - r - 1`` with ``r = ref_logprobs - logprobs``.

    ``r`` is clamped to ``[-20, 20]`` before ``exp`` and the result to ``[-10, 10]`` for stability.

    Runs on: controller or worker (pure function).

    Args:
        logprobs: ``[B, T]`` policy log-probabilities of the sampled tokens.
        ref_logprobs: ``[B, T]`` reference log-probabilities of the same tokens.

    Returns:
        ``[B, T]`` per-token KL estimate (non-negative, at most 10).
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-20.0, 20.0)
    return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, *, estimator: str = "k3") -> Tensor:
    """Per-token KL estimate using the estimator registered as ``estimator``.

    Runs on: controller or worker (pure function).

    Args:
        logprobs: ``[B, T]`` policy log-probabilities of the sampled tokens.
        ref_logprobs: ``[B, T]`` reference log-probabilities of the same tokens.
        estimator: One of ``KL_ESTIMATORS.names()`` (``"k1"``, ``"k2"``, ``"k3"``).

    Returns:
        ``[B, T]`` per-token KL estimate (not masked).

    Raises:
        ValueError: If ``estimator`` is unknown.
    """
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)
