"""Masked reductions and logit helpers shared by the RL algorithms.

All functions are pure: tensors in, tensors out, no host synchronisation. Masks are binary
(``1``/``True`` = valid token, ``0``/``False`` = padding) and may have any dtype; masked-out entries
are excluded with ``torch.where`` so that ``nan``/``inf`` in padding never leaks into results.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "entropy_from_logits",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "scores_to_token_rewards",
]

Dim = int | tuple[int, ...] | None


def _bool_mask(mask: Tensor, like: Tensor) -> Tensor:
    return mask.bool().expand_as(like)


def masked_sum(x: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is set.

    Runs on: controller or worker (pure function).

    Args:
        x: Values, any shape ``[...]``.
        mask: Binary mask broadcastable to ``x.shape``.
        dim: Dimension(s) to reduce; ``None`` reduces everything to a scalar.

    Returns:
        ``x`` summed over ``dim`` ignoring masked-out entries (scalar if ``dim`` is ``None``).
    """
    kept = torch.where(_bool_mask(mask, x), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is set.

    Runs on: controller or worker (pure function).

    Args:
        x: Values, any shape ``[...]``.
        mask: Binary mask broadcastable to ``x.shape``.
        dim: Dimension(s) to reduce; ``None`` reduces everything to a scalar.

    Returns:
        Masked mean over ``dim``; ``0`` where no element is selected (instead of ``nan``).
    """
    m = _bool_mask(mask, x)
    total = masked_sum(x, m, dim)
    count = (m.sum() if dim is None else m.sum(dim=dim)).to(total.dtype)
    return total / torch.where(count > 0, count, torch.ones_like(count))


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all positions where ``mask`` is set.

    Runs on: controller or worker (pure function).

    Args:
        x: Values, any shape ``[...]``.
        mask: Binary mask broadcastable to ``x.shape``.
        unbiased: Apply Bessel's correction ``n / (n - 1)``. Skipped when ``n <= 1`` (no host sync
            is done to raise an error).

    Returns:
        Scalar variance (``0`` if fewer than one element is selected).
    """
    m = _bool_mask(mask, x)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    if unbiased:
        n = m.sum().to(var.dtype)
        var = torch.where(n > 1, var * n / (n - 1).clamp_min(1), var)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalises ``x`` to unit variance (and zero mean) using masked statistics.

    Runs on: controller or worker (pure function).

    Args:
        x: Values, any shape ``[...]``, typically ``[B, T]``.
        mask: Binary mask broadcastable to ``x.shape``; only these entries define mean and variance.
        shift_mean: If ``False``, the mean is added back (only the scale is normalised).
        eps: Added to the variance before ``rsqrt``.

    Returns:
        Whitened tensor with the shape of ``x``. Masked-out positions are transformed too (not zeroed);
        multiply by the mask if zeros are needed there.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def _per_row_float32(logits: Tensor) -> list[Tensor]:
    """Splits ``[B, T, V]`` logits into float32 rows, so a low-precision input is upcast row by row."""
    if logits.dtype == torch.float32:
        return [logits]
    return [row.unsqueeze(0).float() for row in logits]


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probabilities of ``labels`` under ``softmax(logits)``, computed in float32.

    Uses ``logit[label] - logsumexp(logits)`` instead of a full ``log_softmax`` so no extra ``[B, T, V]``
    tensor is materialised; low-precision logits are upcast one batch row at a time.

    Runs on: controller or worker (pure function).

    Args:
        logits: ``[B, T, V]`` unnormalised scores.
        labels: ``[B, T]`` integer token ids in ``[0, V)``.

    Returns:
        ``[B, T]`` float32 log-probabilities (differentiable w.r.t. ``logits``).
    """
    out: list[Tensor] = []
    start = 0
    for chunk in _per_row_float32(logits):
        n = chunk.shape[0]
        lab = labels[start : start + n].long().unsqueeze(-1)
        picked = chunk.gather(-1, lab).squeeze(-1)
        out.append(picked - torch.logsumexp(chunk, dim=-1))
        start += n
    return out[0] if len(out) == 1 else torch.cat(out, dim=0)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of ``softmax(logits)`` along the vocabulary, computed stably in float32.

    Uses ``H = logsumexp(l) - sum(softmax(l) * l)``.

    Runs on: controller or worker (pure function).

    Args:
        logits: ``[B, T, V]`` unnormalised scores.

    Returns:
        ``[B, T]`` float32 entropies (differentiable w.r.t. ``logits``).
    """
    out: list[Tensor] = []
    for chunk in _per_row_float32(logits):
        probs = torch.softmax(chunk, dim=-1)
        out.append(torch.logsumexp(chunk, dim=-1) - (probs * chunk).sum(dim=-1))
    return out[0] if len(out) == 1 else torch.cat(out, dim=0)


def scores_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """Places each sequence-level score on the last valid response token.

    Runs on: controller or worker (pure function).

    Args:
        scores: ``[B]`` sequence-level rewards.
        response_mask: ``[B, T]`` binary mask of response tokens.

    Returns:
        ``[B, T]`` token rewards: ``scores[b]`` at the last ``t`` with ``response_mask[b, t] == 1``,
        zeros elsewhere; an all-zero row if the mask row is empty. Float dtype of ``scores``
        (float32 if ``scores`` is integral).
    """
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    mask = response_mask.bool()
    num_tokens = mask.shape[-1]
    if num_tokens == 0:
        return torch.zeros(mask.shape, dtype=dtype, device=scores.device)
    positions = torch.arange(num_tokens, device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).amax(dim=-1)  # [B], -1 if empty
    has_any = last >= 0
    values = torch.where(has_any, scores.to(dtype), torch.zeros((), dtype=dtype, device=scores.device))
    rewards = torch.zeros(mask.shape, dtype=dtype, device=scores.device)
    rewards.scatter_(-1, last.clamp_min(0).unsqueeze(-1), values.unsqueeze(-1))
    return rewards


def overlong_reward_penalty(lengths: Tensor, *, max_len: int, buffer: int, penalty: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al., 2025): a reward term that grows linearly more negative over
    the last ``buffer`` tokens before ``max_len``.

    ``0`` for ``L <= max_len - buffer``; ``-penalty * (L - (max_len - buffer)) / buffer`` up to ``max_len``;
    ``-penalty`` beyond it.

    Runs on: controller or worker (pure function).

    Args:
        lengths: ``[B]`` response lengths in tokens.
        max_len: the longest allowed response (``RolloutConfig.max_new_tokens``).
        buffer: length of the penalised zone; must be in ``(0, max_len]``.
        penalty: the penalty at ``max_len``.

    Returns:
        ``[B]`` float32 penalties (<= 0), to add to the scores.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer must be in (0, max_len={max_len}], got {buffer}.")
    over = (lengths.float() - (max_len - buffer)).clamp(min=0.0, max=float(buffer))
    return -penalty * over / buffer
