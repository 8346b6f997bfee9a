"""The gap between the policy that sampled a rollout and the one the loss scores (the "rollout mismatch").

The rollout engine samples with its own kernels, precision and, with asynchronous rollouts, older weights
(``pi_rollout``, whose log-probs a batch carries as ``rollout_logprobs``); the loss scores the samples with the
trainer's weights before the update (``pi_old``). These functions measure that gap and correct the loss for it:
truncated importance weights (:func:`rollout_is_weights`) and the engine/trainer agreement metrics
(:func:`rollout_probs_diff`). Shapes: ``[B, R]`` (``B`` samples, ``R`` response tokens); the engine's log-probs
may be narrower than the trainer's (tokens past their width are compared nowhere).

Runs on: controller or worker (pure functions, no config objects).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rollout_is_weights", "rollout_probs_diff"]


def rollout_is_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, level: str, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights ``min(pi_old / pi_rollout, cap)`` ``[B, T]`` (detached), per token or per
    sequence (the product over its tokens), and their metrics ``rollout_is_mean`` and ``rollout_is_clipfrac``.

    Runs on: a worker, inside the actor's loss (pure function).
    """
    width = min(old_logprobs.shape[1], rollout_logprobs.shape[1])
    log_ratio = torch.zeros_like(old_logprobs, dtype=torch.float32)
    log_ratio[:, :width] = old_logprobs[:, :width].detach().float() - rollout_logprobs[:, :width].float()
    log_ratio = log_ratio * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"AlgorithmConfig.asynchronous.rollout_is={level!r}: expected 'token' or 'sequence'.")
    raw = torch.exp(log_ratio.clamp(max=20.0))
    weights = raw.clamp(max=cap)
    m = mask.bool()
    metrics = {
        "rollout_is_mean": weights[m].mean() if m.any() else weights.new_zeros(()),
        "rollout_is_clipfrac": (raw[m] > cap).float().mean() if m.any() else weights.new_zeros(()),
    }
    return weights, metrics


def rollout_probs_diff(logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the rollout engine's distribution is from the trainer's on the sampled response tokens:
    ``rollout_probs_diff_max``/``_mean`` of ``|p_train - p_rollout|`` (verl's; it shrinks with the vocabulary),
    ``rollout_logprob_diff_max``/``_mean`` of ``|log p_train - log p_rollout|``, and ``rollout_kl``, the k3
    estimate of KL(rollout || train), ``mean(r - 1 - log r)`` with ``r = p_train / p_rollout``.

    Runs on: a worker (the on-policy update) or the controller (:meth:`RLHFModule.rollout_metrics`); pure.
    """
    width = min(logprobs.shape[1], rollout_logprobs.shape[1])
    m = mask[:, :width].bool().to(logprobs.device)
    train, rollout = logprobs[:, :width].float()[m], rollout_logprobs[:, :width].to(logprobs.device).float()[m]
    if train.numel() == 0:
        return {}
    diff = (train.exp() - rollout.exp()).abs()
    log_ratio = train - rollout
    gap = log_ratio.abs()
    return {
        "rollout_probs_diff_max": diff.max(),
        "rollout_probs_diff_mean": diff.mean(),
        "rollout_logprob_diff_max": gap.max(),
        "rollout_logprob_diff_mean": gap.mean(),
        "rollout_kl": (torch.expm1(log_ratio) - log_ratio).mean(),
    }
