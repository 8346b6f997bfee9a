"""Training forwards that compute each group's prompt once (a shared prefix).

GRPO-style rollouts hold ``n`` consecutive samples per prompt. Here the rows of a micro-batch are packed into one
sequence: every group's prompt once, then every response's real tokens without padding (a tool episode's mean
response is about 60% of the longest); a custom attention lets each prompt attend causally within itself, and each
response to its group's prompt and causally to itself (inside the attention the responses are padded again, in
chunks of rows of similar lengths: the tool task's update 0.474 -> 0.426 s in isolation). The model is called once
(FSDP's hooks see one forward). Log-probs equal the per-row forward's up to float rounding; the vs-TRL workload's
update, whose 11 prompt tokens are 15% of its decoder tokens, takes about 8% less time
(``benchmarks/bench_shared_prefix.py``). The attention is registered with transformers' ``AttentionInterface``
under :data:`ATTENTION_NAME`, and the model points to it only during a packed call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from lightning_rlhf.batch import Batch
from lightning_rlhf.compat.transformers import attention_implementation

__all__ = ["ATTENTION_NAME", "MODEL_TYPES", "packed_response_logits", "recompute_context", "shares_prompts"]

ATTENTION_NAME = "lightning_rlhf_shared_prefix"
MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
"""Architectures whose attention goes through transformers' attention interface with rotary positions taken from
``position_ids`` (the packed layout needs both)."""


class _Layout(threading.local):
    value: dict[str, Any] | None = None


_LAYOUT = _Layout()


def _attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[Tensor, None]:
    """Attention over the packed layout: ``query``/``key``/``value`` ``[1, H(kv), T, d]``; returns ``[1, T, H, d]``."""
    layout = _LAYOUT.value
    if layout is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention runs only inside a packed forward (packed_response_logits).")
    groups, lp = layout["groups"], layout["lp"]
    heads = query.shape[1]
    # _attend's eager path (below float32) takes as many key/value heads as query heads; SDPA takes them as they are.
    if key.shape[1] != heads and query.dtype != torch.float32:
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    cut = groups * lp

    def prompts(t: Tensor) -> Tensor:  # [groups, H(kv), lp, d]; grouped-query keys/values keep their head count
        return t[0, :, :cut].reshape(t.shape[1], groups, lp, t.shape[-1]).transpose(0, 1)

    def padded(t: Tensor) -> list[Tensor]:  # per chunk [rows, H(kv), width, d]: one row per response
        # One gather for all chunks (one gradient buffer in the backward), then a view per chunk.
        every = t[0, :, cut:].index_select(1, layout["slots"]).split(layout["sizes"], dim=1)
        return [
            part.reshape(t.shape[1], len(c["groups"]), -1, t.shape[-1]).transpose(0, 1)
            for part, c in zip(every, layout["chunks"], strict=True)
        ]

    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    kp, vp = prompts(key), prompts(value)
    out_p = _attend(prompts(query), kp, vp, layout["prompt_attn"], scale)
    d = out_p.shape[-1]
    outs = []
    chunks = zip(layout["chunks"], padded(query), padded(key), padded(value), strict=True)
    for chunk, q, k, v in chunks:  # rows of similar lengths, each chunk padded to its own longest only
        keys = torch.cat([kp.index_select(0, chunk["groups"]), k], dim=2)
        values = torch.cat([vp.index_select(0, chunk["groups"]), v], dim=2)
        out = _attend(q, keys, values, chunk["attn"], scale)
        outs.append(out.transpose(0, 1).reshape(heads, -1, d)[:, chunk["real"]])  # its real tokens, packed
    out_r = torch.cat(outs, dim=1).index_select(1, layout["order"])  # back to the rows' order
    packed = torch.cat([out_p.transpose(0, 1).reshape(heads, cut, d), out_r], 1)
    return packed.transpose(0, 1).unsqueeze(0), None


def _attend(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float) -> Tensor:
    """Softmax attention with a boolean mask. SDPA in float32, where ``k``/``v`` may have fewer heads than ``q``
    (its grouped-query mode reads each key/value head for its query heads, with no repeated copy: the small model's
    packed micro-batch, forward + backward, 13.6 -> 11.2 ms a layer). In lower precision as transformers' eager
    attention computes it, with as many key/value heads as query heads (matmuls on contiguous operands, the softmax
    in float32), which on CPU is faster than SDPA with an explicit mask (bfloat16, the vs-TRL workload's
    micro-batch: 4% faster than one row at a time, against 17% slower through SDPA)."""
    if q.dtype == torch.float32:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
    scores = torch.matmul(q.contiguous(), k.transpose(2, 3).contiguous()) * scale
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v.contiguous())


AttentionInterface.register(ATTENTION_NAME, _attention)
AttentionMaskInterface.register(ATTENTION_NAME, lambda *args, **kwargs: None)  # the attention makes its own masks


def shares_prompts(model: nn.Module, batch: Batch, group_size: int) -> bool:
    """Whether ``batch``'s rows come in consecutive groups of ``group_size`` with identical prompts, for a model
    whose architecture the packed forward knows. Runs on: worker (cheap: one comparison of the prompt tokens)."""
    rows = len(batch)
    if group_size < 2 or rows < group_size or rows % group_size:
        return False
    if getattr(getattr(model, "config", None), "model_type", None) not in MODEL_TYPES:
        return False
    prompts = torch.cat([batch["prompts"], batch["prompt_mask"].to(batch["prompts"].dtype)], dim=1)
    grouped = prompts.view(rows // group_size, group_size, -1)
    responses = batch["response_mask"].bool()
    return bool((grouped == grouped[:, :1]).all()) and bool(responses.any()) and _right_padded(responses)


def _right_padded(mask: Tensor) -> bool:
    """Whether every row of ``mask`` is ones then zeros (a response followed by its padding), as every rollout
    writes it; the packed layout keeps a response's first ``mask.sum()`` tokens."""
    lengths = mask.sum(dim=1, keepdim=True)
    return bool((mask == (torch.arange(mask.shape[1], device=mask.device)[None] < lengths)).all())


@contextlib.contextmanager
def _packed(model: nn.Module, layout: dict[str, Any]) -> Iterator[None]:
    _LAYOUT.value = layout
    try:
        with attention_implementation(model.config, ATTENTION_NAME):
            yield
    finally:
        _LAYOUT.value = None


def recompute_context(config: Any) -> Any:
    """A ``context_fn`` for torch's non-reentrant checkpoint of a model whose config is ``config``: each checkpointed
    call captures the packed layout and the attention name in force, and its recompute in the backward runs with
    them again (the packed call's context has ended by then, on another thread on a GPU). Runs on: worker."""

    def context_fn() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
        return contextlib.nullcontext(), _restored(config, _LAYOUT.value, config._attn_implementation)

    return context_fn


@contextlib.contextmanager
def _restored(config: Any, layout: dict[str, Any] | None, attention: str) -> Iterator[None]:
    previous = _LAYOUT.value
    _LAYOUT.value = layout
    try:
        with attention_implementation(config, attention):
            yield
    finally:
        _LAYOUT.value = previous


CHUNK_ROWS = 16
"""Responses per attention call of the packed forward: the rows sorted by length, each chunk padded to its own
longest (a tool episode batch's lengths spread from about 60 to 203 tokens)."""


def _response_chunks(lengths: Tensor, pmask: Tensor, n: int, device: torch.device) -> dict[str, Any]:
    """The responses' attention in chunks of rows of similar lengths: per chunk its rows' groups, where each padded
    slot reads its token in the packed responses (a padding slot reads token 0, attends to itself only, and its
    output is dropped), which slots are real, and the mask; ``order`` puts the real tokens back in the rows' order."""
    lp = pmask.shape[1]
    starts = torch.cumsum(lengths, 0) - lengths  # each response's first packed position
    by_length = torch.argsort(lengths, descending=True, stable=True)
    chunks, placed = [], []
    for first in range(0, len(lengths), CHUNK_ROWS):
        rows = by_length[first : first + CHUNK_ROWS]
        width = max(1, int(lengths[rows].max()))
        cols = torch.arange(width, device=device)
        real = cols[None] < lengths[rows][:, None]  # [rows, width]
        slots = torch.where(real, starts[rows][:, None] + cols[None], 0)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()[None, None]
        own = (causal & real[:, None, None, :]) | torch.eye(width, dtype=torch.bool, device=device)[None, None]
        group = torch.div(rows, n, rounding_mode="floor")
        shared = pmask.index_select(0, group)[:, None, None, :].expand(-1, 1, width, lp)
        chunks.append({"groups": group, "slots": slots.reshape(-1), "real": real.reshape(-1)})
        chunks[-1]["attn"] = torch.cat([shared, own], dim=-1)
        placed.append(slots[real])
    where = torch.cat(placed)  # the packed position of each chunk output, in chunk order
    order = torch.empty_like(where)
    order[where] = torch.arange(len(where), device=device)
    slots = torch.cat([c["slots"] for c in chunks])
    return {"chunks": chunks, "order": order, "slots": slots, "sizes": [len(c["slots"]) for c in chunks]}


def packed_response_logits(
    model: nn.Module, batch: Batch, group_size: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``(logits, real)``: the logits ``[1, T, V]`` at the positions that predict each real response token (in the
    rows' order) and ``real`` ``[B, R]``, where those tokens sit, with every group's prompt computed once (``batch``
    must pass :func:`shares_prompts`). Runs on: worker (one forward of the FSDP-sharded model)."""
    n = group_size
    prompts = batch["prompts"][::n].to(device)
    pmask = batch["prompt_mask"][::n].to(device).bool()
    responses = batch["responses"].to(device)
    rmask = batch["response_mask"].to(device).bool()
    groups, lp = prompts.shape
    lr = responses.shape[1]
    cut = groups * lp
    lengths = rmask.sum(dim=1)
    eye_p = torch.eye(lp, dtype=torch.bool, device=device)[None, None]
    causal_p = torch.ones(lp, lp, dtype=torch.bool, device=device).tril()[None, None]
    # A padding position attends to itself only (no row of the mask is empty); real positions never see padding.
    prompt_attn = (causal_p & pmask[:, None, None, :]) | eye_p
    layout = {
        "groups": groups,
        "lp": lp,
        "prompt_attn": prompt_attn,
        **_response_chunks(lengths, pmask, n, device),
    }
    input_ids = torch.cat([prompts.reshape(-1), responses[rmask]])[None]
    first_prompt_len = pmask.long().sum(-1)
    prompt_pos = (pmask.long().cumsum(-1) - 1).clamp(min=0)
    response_pos = first_prompt_len.repeat_interleave(n)[:, None] + torch.arange(lr, device=device)[None]
    position_ids = torch.cat([prompt_pos.reshape(-1), response_pos[rmask]])[None]
    # Position p predicts token p + 1: a response's first token is predicted by its group's last prompt position,
    # its token j > 0 by its own token j - 1 (the packed index of that token plus one is the next one's).
    last_prompt = (torch.arange(groups, device=device) * lp + lp - 1).repeat_interleave(n)
    starts = cut + torch.cumsum(lengths, 0) - lengths  # each response's first packed position
    predictor = starts[:, None] + torch.arange(lr, device=device)[None] - 1  # [B, R]: token j's predictor
    predictor[:, 0] = last_prompt
    keep = predictor[rmask]
    with _packed(model, layout):
        logits = model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=keep, use_cache=False).logits
    return logits, rmask
