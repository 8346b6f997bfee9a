"""Masked reductions and logit helpers shared by the RL algorithms.

All functions are pure: tensors in, tensors out, no host synchronisation. Masks are binary
(``1``/``True`` = valid token, ``0``/``False`` = padding) and may have any dtype; masked-out entries
are excluded with ``torch.where`` so that ``nan``/``inf`` in padding never leaks into results.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import Tensor

__all__ = [
    "CHUNK_ELEMENTS",
    "TokenKernels",
    "entropy_from_logits",
    "logprobs_and_entropy",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_reward_penalty",
    "scores_to_token_rewards",
]

Dim = int | tuple[int, ...] | None


class TokenKernels(Protocol):
    """Compiled token log-prob kernels (a device layer's ``token_kernels()``); each returns None where it does not
    take the tensors given, and :func:`logprobs_and_entropy` computes them itself."""

    def token_logprobs(
        self, logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None] | None:
        """``(logp, lse, entropy, mean)`` per position, or None."""

    def token_logprobs_backward(
        self,
        logits: Tensor,
        labels: Tensor,
        lse: Tensor,
        mean: Tensor | None,
        grad_logp: Tensor,
        grad_entropy: Tensor | None,
        temperature: float,
    ) -> Tensor | None:
        """The logits' gradient of ``token_logprobs``, or None."""


def _bool_mask(mask: Tensor, like: Tensor) -> Tensor:
    return mask.bool().expand_as(like)


def masked_sum(x: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` (broadcastable to ``x``) is set, over ``dim`` (None: a scalar).

    Runs on: controller or worker (pure function).
    """
    kept = torch.where(_bool_mask(mask, x), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Dim = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is set, over ``dim`` (arguments as :func:`masked_sum`); ``0``
    where no element is selected (instead of ``nan``). Runs on: controller or worker (pure function)."""
    m = _bool_mask(mask, x)
    total = masked_sum(x, m, dim)
    count = (m.sum() if dim is None else m.sum(dim=dim)).to(total.dtype)
    return total / torch.where(count > 0, count, torch.ones_like(count))


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Scalar variance of ``x`` over all positions where ``mask`` is set (``0`` if none). ``unbiased``: Bessel's
    correction ``n / (n - 1)``, skipped when ``n <= 1`` (no host sync to raise an error).

    Runs on: controller or worker (pure function).
    """
    m = _bool_mask(mask, x)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    if unbiased:
        n = m.sum().to(var.dtype)
        var = torch.where(n > 1, var * n / (n - 1).clamp_min(1), var)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """``(x - mean) * rsqrt(var + eps)`` with the mean and unbiased variance of the entries where ``mask`` is set
    (``shift_mean=False`` adds the mean back). Masked-out positions are transformed too, not zeroed.

    Runs on: controller or worker (pure function).
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


CHUNK_ELEMENTS = 1 << 20
"""Logit elements (positions x vocabulary) that :func:`logprobs_and_entropy` works on at once: 4 MiB of float32
per block whatever the vocabulary, so no temporary ever has the size of the whole ``[B, T, V]`` logits."""


def _blocks(batch: int, length: int, vocab: int, chunk_elements: int) -> list[tuple[slice, slice]]:
    """(batch rows, positions) blocks of at most ``chunk_elements`` logits (at least one position each)."""
    tokens = max(1, chunk_elements // max(vocab, 1))
    if length == 0 or batch == 0:
        return []
    if tokens >= length:
        rows = tokens // length
        return [(slice(b, min(b + rows, batch)), slice(0, length)) for b in range(0, batch, rows)]
    return [
        (slice(b, b + 1), slice(t, min(t + tokens, length))) for b in range(batch) for t in range(0, length, tokens)
    ]


def _tempered(block: Tensor, temperature: float) -> Tensor:
    """``block / temperature`` in float32; the block itself (no copy) when it is float32 and the temperature 1."""
    z = block.float()
    if temperature != 1.0:
        z = z.div_(temperature) if z is not block else z / temperature
    return z


class _TokenLogprobs(torch.autograd.Function):
    """Log-probabilities of labels (and entropies) of tempered logits, forward and backward block by block.

    Saves only the input logits (no copy) and two ``[B, T]`` float32 statistics per row; the backward recomputes
    ``softmax`` one block at a time and writes the gradient straight into one buffer shaped like the logits.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        logits: Tensor,
        labels: Tensor,
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool,
        chunk_elements: int,
        kernels: TokenKernels | None,
    ) -> tuple[Tensor, Tensor]:
        differentiable_entropy = with_entropy and entropy_grad
        ctx.set_materialize_grads(False)
        ctx.temperature, ctx.chunk_elements, ctx.kernels = temperature, chunk_elements, kernels
        compiled = None
        if kernels is not None and _kernels_take(logits):
            compiled = kernels.token_logprobs(logits, labels, temperature, with_entropy)
        if compiled is not None:  # CPU: one pass per position (the same formulas)
            logp, lse, entropy_or_none, mean = compiled
            entropy = entropy_or_none if entropy_or_none is not None else torch.empty(0, dtype=torch.float32)
        else:
            batch, length, vocab = logits.shape
            float_kw: dict[str, Any] = {"dtype": torch.float32, "device": logits.device}
            logp = torch.empty(batch, length, **float_kw)
            lse = torch.empty(batch, length, 1, **float_kw)
            entropy = torch.empty(batch, length, **float_kw) if with_entropy else torch.empty(0, **float_kw)
            mean = torch.empty(batch, length, 1, **float_kw) if with_entropy else None
            for rows, cols in _blocks(batch, length, vocab, chunk_elements):
                z = _tempered(logits[rows, cols], temperature)
                top = z.amax(dim=-1, keepdim=True)
                top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows of -inf stay -inf, not nan
                exp = torch.sub(z, top).exp_()
                total = exp.sum(dim=-1, keepdim=True)
                block_lse = total.log().add_(top)
                lse[rows, cols] = block_lse
                logp[rows, cols] = (z.gather(-1, labels[rows, cols].long().unsqueeze(-1)) - block_lse).squeeze(-1)
                if mean is not None:
                    block_mean = exp.mul_(z).sum(dim=-1, keepdim=True).div_(total)  # E_p[z]; H = lse - E_p[z]
                    mean[rows, cols] = block_mean
                    entropy[rows, cols] = (block_lse - block_mean).squeeze(-1)
        if not differentiable_entropy:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logits, labels, lse, mean if differentiable_entropy else None)
        return logp, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_logp: Tensor | None, grad_entropy: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        logits, labels, lse, mean = ctx.saved_tensors
        nones = (None,) * 6
        if mean is None:
            grad_entropy = None
        if grad_logp is None and grad_entropy is None:
            return (None, *nones)
        temperature: float = ctx.temperature
        kernels: TokenKernels | None = ctx.kernels
        if kernels is not None and _kernels_take(logits):
            g_lp = grad_logp if grad_logp is not None else torch.zeros(lse.shape[:-1], dtype=torch.float32)
            compiled = kernels.token_logprobs_backward(logits, labels, lse, mean, g_lp, grad_entropy, temperature)
            if compiled is not None:
                return (compiled, *nones)
        batch, length, vocab = logits.shape
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        # d logp_y / dz = onehot(y) - p;  d H / dz = -p * (z - E_p[z]);  dz / dlogits = 1 / temperature
        g_lp = (grad_logp if grad_logp is not None else torch.zeros_like(lse.squeeze(-1))).unsqueeze(-1)
        g_ent = grad_entropy.unsqueeze(-1) if grad_entropy is not None else None
        for rows, cols in _blocks(batch, length, vocab, ctx.chunk_elements):
            z = _tempered(logits[rows, cols], temperature)
            out = grad[rows, cols]
            work = out if out.dtype == torch.float32 else torch.empty_like(z)
            torch.sub(z, lse[rows, cols], out=work).exp_()  # p
            lp_blk = g_lp[rows, cols]
            if g_ent is not None:
                work.mul_(torch.sub(z, mean[rows, cols]).mul_(g_ent[rows, cols]).add_(lp_blk).neg_())
            else:
                work.mul_(lp_blk.neg())
            work.scatter_add_(-1, labels[rows, cols].long().unsqueeze(-1), lp_blk)
            if temperature != 1.0:
                work.div_(temperature)
            if work is not out:
                out.copy_(work)
        return (grad, *nones)


def _kernels_take(logits: Tensor) -> bool:
    """Whether compiled token kernels may be given ``logits``: contiguous float32/bfloat16 on CPU (the kernels
    themselves say whether they run)."""
    return logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) and logits.is_contiguous()


def logprobs_and_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_elements: int = CHUNK_ELEMENTS,
    kernels: TokenKernels | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of ``labels`` (and entropies) under ``softmax(logits / temperature)``, in float32.

    Never materialises a second tensor of the size of ``logits``: ``log p(y) = z_y - logsumexp(z)`` and
    ``H = logsumexp(z) - E_p[z]`` are computed block by block (``chunk_elements`` logits at a time, upcast to
    float32 and divided by the temperature per block only; at temperature 1 a float32 block is used as is), and
    the backward recomputes the softmax per block, writing into one gradient buffer shaped like ``logits``. With
    ``kernels`` (the CPU layer's, for contiguous float32/bfloat16 logits on CPU) both run as compiled kernels
    instead, one pass per position (the same formulas, sums in double; ``chunk_elements`` unused).

    ``logits`` ``[B, T, V]`` (not modified), ``labels`` ``[B, T]``; returns ``(logprobs, entropy)``, ``[B, T]``
    float32 each (``entropy`` None unless ``with_entropy``). ``entropy_grad=False`` makes the entropy a plain
    number (the backward then skips its term); results do not depend on ``chunk_elements``.

    Runs on: controller or worker (pure function).

    Raises:
        ValueError: If the shapes do not fit, ``temperature`` is not positive, or ``chunk_elements < 1``.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"logprobs_and_entropy: logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not fit. "
            "HINT: pass logits [B, T, V] and labels [B, T]."
        )
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(
            f"logprobs_and_entropy: temperature={temperature} is not a positive number. "
            "HINT: greedy decoding (temperature 0) scores with temperature 1."
        )
    if chunk_elements < 1:
        raise ValueError(f"logprobs_and_entropy: chunk_elements={chunk_elements} must be >= 1.")
    logp, entropy = _TokenLogprobs.apply(
        logits, labels, temperature, with_entropy, entropy_grad, chunk_elements, kernels
    )
    return logp, (entropy if with_entropy else None)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """``[B, T]`` float32 log-probabilities of ``labels`` under ``softmax(logits)``, block by block
    (:func:`logprobs_and_entropy`). Runs on: controller or worker (pure function)."""
    return logprobs_and_entropy(logits, labels)[0]


def entropy_from_logits(logits: Tensor) -> Tensor:
    """``[B, T]`` float32 entropies of ``softmax(logits)``, block by block (:func:`logprobs_and_entropy`).
    Runs on: controller or worker (pure function)."""
    labels = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    entropy = logprobs_and_entropy(logits, labels, with_entropy=True)[1]
    assert entropy is not None
    return entropy


def scores_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """``[B, T]`` token rewards: each ``[B]`` score on the last valid token of ``response_mask``, zeros elsewhere
    (and on an empty row); in the float dtype of ``scores`` (float32 if integral).

    Runs on: controller or worker (pure function).
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
    """DAPO's soft overlong punishment (Yu et al., 2025): ``[B]`` float32 penalties (<= 0) to add to the scores of
    responses of ``lengths`` tokens: ``0`` for ``L <= max_len - buffer``, ``-penalty * (L - (max_len - buffer)) /
    buffer`` up to ``max_len`` (``RolloutConfig.max_new_tokens``), ``-penalty`` beyond.

    Runs on: controller or worker (pure function).

    Raises:
        ValueError: If ``buffer`` is not in ``(0, max_len]``.
    """
    if not 0 < buffer <= max_len:
        raise ValueError(f"overlong buffer must be in (0, max_len={max_len}], got {buffer}.")
    over = (lengths.float() - (max_len - buffer)).clamp(min=0.0, max=float(buffer))
    return -penalty * over / buffer
