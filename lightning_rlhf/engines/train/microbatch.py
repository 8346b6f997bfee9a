"""Micro-batches without padding: trim the columns that are padding in every row, pack rows by a token budget,
and balance rows over data-parallel ranks by their tokens.

A training forward costs rows x padded width. :func:`trim_padding` drops the columns that are padding in every row
(the forward gives the same outputs at every real token, up to float summation order);
:func:`plan_micro_batches` packs rows of similar lengths under a row cap and a padded-token budget;
:func:`split_to_count` evens the number of forwards over ranks (FSDP's collectives need that);
:func:`balanced_partition` (from :mod:`lightning_rlhf.controller.dispatch`, re-exported) balances the ranks' tokens.

Which columns :func:`trim_padding` cuts: *prompt-aligned* ones (the name starts with ``"prompt"`` and dim 1 is the
prompt width ``P``) lose their leading columns; *response-aligned* ones (every other tensor column with at least 2
dims whose dim 1 is the response width ``R``: ``responses``, ``old_logprobs``, ``advantages``, ...) their trailing
columns; everything else (per-row tensors, list columns, ``meta``) is kept. Prompt columns are recognised by name
first, so ``P == R`` is not misread; a column of another meaning whose dim 1 happens to equal ``R`` would be cut too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_rlhf.batch import Batch
from lightning_rlhf.controller.dispatch import balanced_partition

__all__ = [
    "balanced_partition",
    "has_rollout_layout",
    "plan_micro_batches",
    "response_aligned",
    "row_spans",
    "split_to_count",
    "trim_padding",
]

Lengths = Sequence[int] | Sequence[tuple[int, ...]]
"""Per-row lengths: an int per row (one padded segment), or a tuple per row, one entry per segment that is padded
on its own (prompt and response: ``(prompt_len, response_len)``)."""


def has_rollout_layout(batch: Batch) -> bool:
    """Whether ``batch`` has the rollout layout: 2-D ``prompts``/``prompt_mask`` ``[B, P]`` and
    ``responses``/``response_mask`` ``[B, R]`` tensors. Runs on: any process."""
    keys = ("prompts", "prompt_mask", "responses", "response_mask")
    return all(key in batch.tensors and batch.tensors[key].dim() == 2 for key in keys)


def _prompt_aligned(key: str, value: Tensor, prompt_width: int) -> bool:
    return key.startswith("prompt") and value.dim() >= 2 and value.shape[1] == prompt_width


def response_aligned(batch: Batch) -> list[str]:
    """Names of the response-aligned tensor columns of a rollout batch (the rule in the module docstring). Runs on:
    any process."""
    prompt_width = batch["prompt_mask"].shape[1]
    width = batch["response_mask"].shape[1]
    return [
        key
        for key, value in batch.tensors.items()
        if value.dim() >= 2 and value.shape[1] == width and not _prompt_aligned(key, value, prompt_width)
    ]


def row_spans(batch: Batch) -> list[tuple[int, int]]:
    """``(prompt span, response span)`` of each row of a rollout batch: the prompt columns from the row's first real
    prompt token to the end, and the response columns up to and including its last real response token. Runs on:
    any process."""
    prompt_mask = batch["prompt_mask"].bool()
    response_mask = batch["response_mask"].bool()
    width_p, width_r = prompt_mask.shape[1], response_mask.shape[1]
    cols_p = torch.arange(width_p, device=prompt_mask.device)
    cols_r = torch.arange(1, width_r + 1, device=response_mask.device)
    first = torch.where(prompt_mask, cols_p, width_p).amin(dim=1) if width_p else torch.zeros(len(batch))
    last = torch.where(response_mask, cols_r, 0).amax(dim=1) if width_r else torch.zeros(len(batch))
    prompt_spans = (width_p - first).tolist()
    return [(int(p), int(r)) for p, r in zip(prompt_spans, last.tolist(), strict=True)]


def trim_padding(batch: Batch, *, responses: bool = True) -> Batch:
    """``batch`` without the leading prompt columns and the trailing response columns that are padding in every row
    (the rule in the module docstring). At least one prompt and one response column stay (a position must predict
    the first response token). A batch without the rollout layout comes back as it is. ``responses=False`` cuts
    only the prompt side (for a loss that depends on the response width).

    Runs on: any process (a worker, before each forward).
    """
    if not has_rollout_layout(batch) or not len(batch):
        return batch
    spans = row_spans(batch)
    width_p, width_r = batch["prompt_mask"].shape[1], batch["response_mask"].shape[1]
    keep_p = min(width_p, max(1, max(p for p, _ in spans)))
    keep_r = min(width_r, max(1, max(r for _, r in spans))) if responses else width_r
    if keep_p == width_p and keep_r == width_r:
        return batch
    resp_keys = set(response_aligned(batch)) if keep_r < width_r else set()
    tensors: dict[str, Tensor] = {}
    for key, value in batch.tensors.items():
        if keep_p < width_p and _prompt_aligned(key, value, width_p):
            value = value[:, width_p - keep_p :]
        elif key in resp_keys:
            value = value[:, :keep_r]
        tensors[key] = value
    return Batch(tensors, batch.columns, batch.meta)


def _as_tuples(lengths: Lengths) -> list[tuple[int, ...]]:
    rows = [(x,) if isinstance(x, int) else tuple(x) for x in lengths]
    for i, row in enumerate(rows):
        if any(int(v) < 0 for v in row):
            raise ValueError(f"lengths[{i}]={row} is negative. HINT: pass token counts (>= 0) per row.")
    if len({len(r) for r in rows}) > 1:
        raise ValueError("lengths mix rows of different segment counts. HINT: one int per row, or one tuple per row.")
    return rows


def plan_micro_batches(lengths: Lengths, *, max_rows: int, max_tokens: int) -> list[list[int]]:
    """Row indices of each micro-batch: rows sorted by length (stable), packed greedily into micro-batches of at most
    ``max_rows`` rows and ``max_tokens`` padded tokens: rows x the longest row, or with tuple lengths (segments
    padded separately, e.g. ``(prompt, response)``) rows x the sum of each segment's longest. A row over
    ``max_tokens`` alone gets a micro-batch of its own. Runs on: any process (deterministic).

    Raises:
        ValueError: ``max_rows`` or ``max_tokens`` below 1, a negative length, or rows of different segment counts.
    """
    if max_rows < 1:
        raise ValueError(f"plan_micro_batches: max_rows={max_rows} must be >= 1. HINT: micro_batch_size >= 1.")
    if max_tokens < 1:
        raise ValueError(f"plan_micro_batches: max_tokens={max_tokens} must be >= 1. HINT: micro_batch_tokens >= 1.")
    rows = _as_tuples(lengths)
    order = sorted(range(len(rows)), key=lambda i: sum(rows[i]))  # sorted() is stable
    plan: list[list[int]] = []
    current: list[int] = []
    widths: list[int] = []
    for i in order:
        grown = [max(w, v) for w, v in zip(widths, rows[i], strict=True)] if current else list(rows[i])
        if current and (len(current) + 1 > max_rows or (len(current) + 1) * sum(grown) > max_tokens):
            plan.append(current)
            current, grown = [], list(rows[i])
        current.append(i)
        widths = grown
    if current:
        plan.append(current)
    return plan


def split_to_count(plan: list[list[int]], lengths: Lengths, count: int) -> list[list[int]]:
    """``plan`` with its micro-batches split until there are ``count`` of them.

    Runs on: every worker rank. The costliest micro-batch (padded tokens, see :func:`plan_micro_batches`; ties: the
    first) of two rows or more is split into halves (the first half gets the extra row) until the counts agree.
    Splitting never raises a micro-batch's cost, so both caps still hold. Deterministic.

    Raises:
        ValueError: ``count`` is below ``len(plan)`` or above the number of rows.
    """
    rows = _as_tuples(lengths)
    total = sum(len(g) for g in plan)
    if not len(plan) <= count <= total:
        raise ValueError(
            f"split_to_count: cannot turn {len(plan)} micro-batches of {total} rows into {count}. "
            "HINT: every rank must hold the same number of rows (DP_SPLIT splits evenly)."
        )
    out = [list(g) for g in plan]

    def cost(group: list[int]) -> int:
        return len(group) * sum(max(col) for col in zip(*(rows[i] for i in group), strict=True))  # padded tokens

    while len(out) < count:
        k = max((k for k in range(len(out)) if len(out[k]) > 1), key=lambda k: (cost(out[k]), -k))
        half = (len(out[k]) + 1) // 2
        out[k : k + 1] = [out[k][:half], out[k][half:]]
    return out
