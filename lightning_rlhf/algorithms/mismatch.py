"""The gap between the policy that sampled a rollout and the one the loss scores (the "rollout mismatch").

The rollout engine samples with its own kernels, precision and, with asynchronous rollouts, older weights
(``pi_rollout``, whose log-probs a batch carries as ``rollout_logprobs``); the loss scores the samples with the
trainer's weights before the update (``pi_old``). These functions measure that gap and correct the loss for it:
truncated importance weights (:func:`rollout_is_weights`), masks that leave out the tokens or sequences whose ratio
``pi_old / pi_rollout`` is out of bounds (:func:`rollout_mask`), the metrics of the gap on every step
(:func:`mismatch_metrics`) and the engine/trainer agreement metrics (:func:`rollout_probs_diff`). Shapes:
``[B, R]`` (``B`` samples, ``R`` response tokens); the engine's log-probs may be narrower than the trainer's
(tokens past their width are compared nowhere).

Runs on: controller or worker (pure functions, no config objects).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_rlhf.algorithms.kl import kl_k3

__all__ = [
    "MISMATCH_METRICS",
    "ROLLOUT_MASKS",
    "mismatch_metrics",
    "rollout_is_weights",
    "rollout_log_ratio",
    "rollout_mask",
    "rollout_probs_diff",
]

ROLLOUT_MASKS: dict[str, tuple[float, float]] = {
    "token": (0.125, 8.0),
    "sequence": (0.0, 3.0),
    "geometric": (0.99, 1.01),
}
"""The masking modes of :func:`rollout_mask` and their default ``(low, high)`` bounds on the ratio
``pi_old / pi_rollout``: per token prime-rl's ``token_mask_low/high``; per sequence (the product of the token
ratios) TRL's ``vllm_importance_sampling_mode="sequence_mask"`` with its cap 3.0 and no lower bound; the geometric
mean of the sequence's token ratios SkyRL's ``geo_mask_low/high``. A bound of 0 is no lower bound."""

MISMATCH_METRICS = ("mismatch_kl", "ess", "ratio_max", "masked_fraction")
"""The names of :func:`mismatch_metrics` (the actor logs them as ``rollout/<name>``)."""


def rollout_log_ratio(old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``log(pi_old / pi_rollout)`` per token ``[B, T]`` (float32, detached): 0 outside ``mask`` and past the width
    of ``rollout_logprobs``.

    Runs on: a worker, inside the actor's loss (pure function).
    """
    width = min(old_logprobs.shape[1], rollout_logprobs.shape[1])
    log_ratio = torch.zeros_like(old_logprobs, dtype=torch.float32)
    log_ratio[:, :width] = old_logprobs[:, :width].detach().float() - rollout_logprobs[:, :width].float()
    return log_ratio * mask


def rollout_mask(log_ratio: Tensor, mask: Tensor, *, mode: str, low: float, high: float) -> Tensor:
    """Which tokens the loss keeps ``[B, T]`` (1.0 kept, 0.0 masked; 1.0 outside ``mask``), from the log-ratios of
    :func:`rollout_log_ratio` and the bounds ``low <= ratio <= high`` (``low`` 0: no lower bound):

    - ``"token"``: a token is masked when its own ratio ``pi_old / pi_rollout`` is out of bounds;
    - ``"sequence"``: every token of a sequence is masked when the product of its token ratios (the sequence's
      likelihood ratio) is out of bounds (TRL's ``sequence_mask``);
    - ``"geometric"``: the same with the geometric mean of its token ratios, ``exp(mean log ratio)``, a per-token
      average that does not grow with the length (SkyRL's ``sequence_mask_metric="geometric"``).

    The bounds are compared in log space, so no ratio overflows. Runs on: a worker, inside the actor's loss (pure).

    Raises:
        ValueError: If ``mode`` is none of :data:`ROLLOUT_MASKS`.
    """
    if mode == "token":
        stat = log_ratio
    elif mode in ("sequence", "geometric"):
        stat = (log_ratio * mask).sum(-1, keepdim=True)
        if mode == "geometric":
            stat = stat / mask.sum(-1, keepdim=True).clamp(min=1)
    else:
        raise ValueError(f"AlgorithmConfig.asynchronous.rollout_mask={mode!r}: expected one of {list(ROLLOUT_MASKS)}.")
    lower = math.log(low) if low > 0 else -math.inf
    inside = (stat >= lower) & (stat <= math.log(high))
    return (inside | ~mask.bool()).to(log_ratio.dtype)


def mismatch_metrics(log_ratio: Tensor, mask: Tensor, keep: Tensor | None = None) -> dict[str, Tensor]:
    """The gap between the rollout policy and the trained one over the tokens of ``mask`` (the loss's), from the
    per-token ratios ``r = pi_old / pi_rollout`` (``log_ratio`` of :func:`rollout_log_ratio`):

    - ``mismatch_kl``: the k3 estimate of KL(pi_rollout || pi_old), ``mean(r - 1 - log r)``
      (:func:`~lightning_rlhf.algorithms.kl.kl_k3`; 0 when the two policies agree);
    - ``ess``: the effective sample size of the token ratios over the number of tokens,
      ``(sum r)^2 / (n * sum r^2)`` in (0, 1] (1: every ratio equal; verl's ``rollout_is_eff_sample_size``);
    - ``ratio_max``: the largest token ratio;
    - ``masked_fraction``: the share of the tokens that ``keep`` (:func:`rollout_mask`) leaves out (0 without).

    An empty ``mask`` gives ``{}``. Runs on: a worker, inside the actor's loss (pure function).
    """
    m = mask.bool()
    if not m.any():
        return {}
    lr = log_ratio[m].float()
    ratio = torch.exp(lr.clamp(-20.0, 20.0))
    masked = (keep[m] == 0).float().mean() if keep is not None else ratio.new_zeros(())
    return {
        # kl_k3(log pi_rollout, log pi_old), both - log pi_rollout; each term is >= 0 but for float32 rounding
        "mismatch_kl": kl_k3(torch.zeros_like(lr), lr).clamp(min=0).mean(),
        "ess": ratio.sum().square() / (ratio.numel() * ratio.square().sum()).clamp(min=1e-30),
        "ratio_max": ratio.max(),
        "masked_fraction": masked,
    }


def rollout_is_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, *, level: str, cap: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance weights ``min(pi_old / pi_rollout, cap)`` ``[B, T]`` (detached), per token or per
    sequence (the product over its tokens), and their metrics ``rollout_is_mean`` and ``rollout_is_clipfrac``.

    Runs on: a worker, inside the actor's loss (pure function).
    """
    log_ratio = rollout_log_ratio(old_logprobs, rollout_logprobs, mask)
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
    ``rollout_probs_diff_max``/``_mean`` of ``|p_train - p_rollout|`` (verl's; it shrinks with the vocabulary) and
    ``rollout_logprob_diff_max``/``_mean`` of ``|log p_train - log p_rollout|``. The KL between the two is
    :func:`mismatch_metrics`'s ``mismatch_kl``.

    Runs on: a worker (the on-policy update) or the controller (:meth:`RLHFModule.rollout_metrics`); pure.
    """
    width = min(logprobs.shape[1], rollout_logprobs.shape[1])
    m = mask[:, :width].bool().to(logprobs.device)
    train, rollout = logprobs[:, :width].float()[m], rollout_logprobs[:, :width].to(logprobs.device).float()[m]
    if train.numel() == 0:
        return {}
    diff = (train.exp() - rollout.exp()).abs()
    gap = (train - rollout).abs()
    return {
        "rollout_probs_diff_max": diff.max(),
        "rollout_probs_diff_mean": diff.mean(),
        "rollout_logprob_diff_max": gap.max(),
        "rollout_logprob_diff_mean": gap.mean(),
    }
