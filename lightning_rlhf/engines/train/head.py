"""The causal LM's head and the token log-probs computed together, block by block: the ``[T, V]`` logits of a
micro-batch never exist whole.

At a real vocabulary the logits dominate a training forward's memory once the blocks are checkpointed: Qwen2.5's
151,936-token head gives 0.6 GB of float32 logits for two 512-token rows, and their gradient as much again.
:class:`TokenHead` replaces the head's ``forward`` for one model call, so the log-probs (and entropies) are computed
inside the model's own forward, ``HEAD_CHUNK_ELEMENTS`` logits at a time; under gradients each block is checkpointed
(its logits recomputed in the backward: one more head matmul per token). What the model returns in ``.logits`` is
then ``[B, K, 1]`` (log-probs) or ``[B, K, 2]`` (log-probs, entropies): going back through the model's output keeps
FSDP2's pre-backward hook on it, so the head's weight is gathered when the backward reaches it.

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
from torch.utils.checkpoint import checkpoint

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
        return out[..., 0], (out[..., 1] if self.token_kwargs.get("with_entropy") else None)

    def _forward(self, hidden: Tensor) -> Tensor:
        """The head's replacement: ``hidden`` ``[B, K, H]`` to ``[B, K, 1 or 2]`` float32 (log-prob, entropy)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        labels = self.labels.reshape(-1).to(hidden.device)
        if flat.shape[0] != labels.shape[0]:
            raise RuntimeError(
                f"TokenHead: the head got {flat.shape[0]} positions for {labels.shape[0]} labels. HINT: the model "
                "must pass `logits_to_keep`'s positions alone to its head."
            )
        recompute = torch.is_grad_enabled() and (flat.requires_grad or self.linear.weight.requires_grad)  # type: ignore[union-attr]
        blocks = []
        for start in range(0, flat.shape[0], self.block_rows):
            rows = slice(start, start + self.block_rows)
            if recompute:  # keep the block's input only; its logits come back in the backward
                blocks.append(checkpoint(self._block, flat[rows], labels[rows], use_reentrant=False))
            else:
                blocks.append(self._block(flat[rows], labels[rows]))
        return torch.cat(blocks).view(*hidden.shape[:-1], -1)

    def _block(self, hidden: Tensor, labels: Tensor) -> Tensor:
        """One block: its logits, then their log-probs (and entropies) as ``[n, 1 or 2]``."""
        assert self.linear is not None
        logits = F.linear(hidden, self.linear.weight)
        logp, entropy = logprobs_and_entropy(logits[None], labels[None], **self.token_kwargs)
        return logp[0, :, None] if entropy is None else torch.stack([logp[0], entropy[0]], dim=-1)


def _plain_head(model: nn.Module) -> nn.Linear | None:
    """The model's output embedding when it is a bias-free ``nn.Linear`` whose output the model returns unchanged
    (no softcapping or scaling in its configuration); else None."""
    config = getattr(model, "config", None)
    if config is None or any(getattr(config, name, None) not in (None, 1, 1.0) for name in _RESCALED_LOGITS):
        return None
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if type(head) is nn.Linear and head.bias is None else None
