"""The causal LM's head and the token log-probs computed together, block by block: the ``[T, V]`` logits of a
micro-batch never exist whole.

At a real vocabulary the logits dominate a training forward's memory once the blocks are checkpointed: Qwen2.5's
151,936-token head gives 0.6 GB of float32 logits for two 512-token rows, and their gradient as much again.
:class:`TokenHead` replaces the head's ``forward`` for one model call, so the log-probs (and entropies) are computed
inside the model's own forward, ``HEAD_CHUNK_ELEMENTS`` logits at a time; the backward recomputes each block's
logits (one more head matmul per token) and adds its share into one gradient of the head's weight. What the model
returns in ``.logits`` is then ``[B, K, 1]`` (log-probs) or ``[B, K, 2]`` (log-probs, entropies): going back through
the model's output keeps FSDP2's pre-backward hook on it, so the head's weight is gathered when the backward reaches
it.

The same role in verl is its optional fused kernels (hidden states to log-probs); here the blocks reuse the
project's own token log-prob function (:func:`~lightning_rlhf.algorithms.functional.logprobs_and_entropy`), so the
numbers are those of the whole-logits path up to the matmul's rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from lightning_rlhf.algorithms.functional import logprobs_and_entropy

__all__ = ["HEAD_CHUNK_ELEMENTS", "TokenHead"]

HEAD_CHUNK_ELEMENTS = 1 << 25
"""Logits per block of the head (128 MiB in float32); a micro-batch with no more than this many logits is computed
whole, as before (a small vocabulary never takes the blocked path)."""

_RESCALED_LOGITS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Configuration fields of models whose forward changes the head's output before returning it: those keep the
whole-logits path (their ``.logits`` must be real logits)."""


class TokenHead:
    """Token log-probs (and entropies) of ``labels`` ``[B, K]`` from one call of ``model`` with ``logits_to_keep``
    selecting K positions (``token_kwargs``: those of :func:`logprobs_and_entropy`). Use::

        head = TokenHead(model, labels, temperature=..., with_entropy=..., entropy_grad=..., kernels=...)
        with head.installed():
            out = model(..., logits_to_keep=keep).logits
        logprobs, entropy = head.read(out)

    When the logits would exceed ``head_elements`` (None: :data:`HEAD_CHUNK_ELEMENTS`) and the model's head is a
    plain ``nn.Linear`` whose output the model returns as it is, the head computes the log-probs in blocks of rows;
    otherwise ``installed`` changes nothing and ``read`` computes them from the whole logits.

    Runs on: worker (inside a role's forward).
    """

    def __init__(
        self,
        model: nn.Module,
        labels: Tensor,
        *,
        head_elements: int | None = None,
        **token_kwargs: Any,
    ) -> None:
        self.labels = labels
        self.token_kwargs = token_kwargs
        head_elements = HEAD_CHUNK_ELEMENTS if head_elements is None else head_elements
        head = _plain_head(model)
        rows = labels.numel()
        self.linear = head if head is not None and rows * head.out_features > head_elements else None
        self.block_rows = max(1, head_elements // head.out_features) if head is not None else rows

    @property
    def blocked(self) -> bool:
        """Whether the log-probs are computed inside the head, in blocks."""
        return self.linear is not None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The head's ``forward`` replaced by the blocked log-probs for the duration (nothing when not
        :attr:`blocked`)."""
        if self.linear is None:
            yield
            return
        self.linear.forward = self._forward  # type: ignore[method-assign, assignment]
        try:
            yield
        finally:
            del self.linear.forward

    def read(self, out: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(logprobs, entropy)`` ``[B, K]`` float32 from the model's ``.logits``: the blocked head's own output, or
        whole logits."""
        if self.linear is None:
            return logprobs_and_entropy(out, self.labels, **self.token_kwargs)
        if not self.token_kwargs.get("with_entropy"):
            return out[..., 0], None
        entropy = out[..., 1]
        return out[..., 0], (entropy if self.token_kwargs.get("entropy_grad", True) else entropy.detach())

    def _forward(self, hidden: Tensor) -> Tensor:
        """The head's replacement: ``hidden`` ``[B, K, H]`` to ``[B, K, 1 or 2]`` float32 (log-prob, entropy)."""
        assert self.linear is not None
        flat = hidden.reshape(-1, hidden.shape[-1])
        labels = self.labels.reshape(-1).to(hidden.device)
        if flat.shape[0] != labels.shape[0]:
            raise RuntimeError(
                f"TokenHead: the head got {flat.shape[0]} positions for {labels.shape[0]} labels. HINT: the model "
                "must pass `logits_to_keep`'s positions alone to its head."
            )
        out = _HeadLogprobs.apply(flat, self.linear.weight, labels, self.block_rows, self.token_kwargs)
        return out.view(*hidden.shape[:-1], -1)


class _HeadLogprobs(torch.autograd.Function):
    """``[N, 1 or 2]`` log-probs (and entropies) of ``labels`` under ``hidden @ weight.T``, ``rows`` positions at a
    time. Saves the inputs only; the backward recomputes each block's logits, takes their gradient from
    :func:`logprobs_and_entropy`'s own backward, and adds the block's share into one gradient of the weight (float32
    when the weight is 16-bit) and of the hidden states."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, labels: Tensor, rows: int, token_kwargs: dict[str, Any]
    ) -> Tensor:
        ctx.rows, ctx.token_kwargs = rows, token_kwargs
        ctx.save_for_backward(hidden, weight, labels)
        blocks = []
        for start in range(0, hidden.shape[0], rows):
            logp, entropy = _block(hidden[start : start + rows], weight, labels[start : start + rows], token_kwargs)
            blocks.append(logp[:, None] if entropy is None else torch.stack([logp, entropy], dim=-1))
        return torch.cat(blocks)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, labels = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if grad_out is None or not (need_hidden or need_weight):
            return None, None, None, None, None
        kwargs = ctx.token_kwargs
        entropy_grad = bool(kwargs.get("with_entropy")) and kwargs.get("entropy_grad", True)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        wide = weight.dtype if weight.dtype == torch.float32 else torch.float32
        grad_weight = torch.zeros(weight.shape, dtype=wide, device=weight.device) if need_weight else None
        for start in range(0, hidden.shape[0], ctx.rows):
            rows = slice(start, start + ctx.rows)
            h = hidden[rows]
            with torch.enable_grad():
                logits = F.linear(h, weight).detach().requires_grad_()
                logp, entropy = logprobs_and_entropy(logits[None], labels[None, rows], **kwargs)
                outputs, grads = [logp[0]], [grad_out[rows, 0]]
                if entropy_grad and entropy is not None:
                    outputs.append(entropy[0])
                    grads.append(grad_out[rows, 1])
                (grad_logits,) = torch.autograd.grad(outputs, logits, grads)
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[rows])
            if grad_weight is not None:
                if grad_weight.dtype == grad_logits.dtype:
                    grad_weight.addmm_(grad_logits.t(), h)
                else:
                    grad_weight.add_(grad_logits.t().mm(h))
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _block(
    hidden: Tensor, weight: Tensor, labels: Tensor, token_kwargs: dict[str, Any]
) -> tuple[Tensor, Tensor | None]:
    """One block without gradients: its logits, then their log-probs (and entropies), ``[n]`` each."""
    with torch.no_grad():
        logp, entropy = logprobs_and_entropy(F.linear(hidden, weight)[None], labels[None], **token_kwargs)
    return logp[0], (entropy[0] if entropy is not None else None)


def _plain_head(model: nn.Module) -> nn.Linear | None:
    """The model's output embedding when it is a bias-free ``nn.Linear`` whose output the model returns unchanged
    (no softcapping or scaling in its configuration); else None."""
    config = getattr(model, "config", None)
    if config is None or any(getattr(config, name, None) not in (None, 1, 1.0) for name in _RESCALED_LOGITS):
        return None
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if type(head) is nn.Linear and head.bias is None else None
