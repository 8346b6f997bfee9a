"""The batch that moves between the controller and the workers.

A :class:`Batch` is a set of columns that all share the first (batch) dimension: tensors (token ids, masks,
log-probs, ...) and plain Python lists (prompt text, reference answers, data source, ...). It is what every
role method takes and returns, and what the transfer protocols split and concatenate.

Why not ``tensordict``: our non-tensor columns are ragged Python lists (prompt token ids of different lengths,
strings), which ``TensorDict`` holds only through ``NonTensorStack`` wrappers, and the controller needs nothing else
from it. A hundred typed lines keep the wire format plain (pickled dicts of CPU tensors and lists), keep mypy useful,
and remove one package whose releases are pinned to torch releases (vLLM pins torch too)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["Batch", "sampled_mask"]


class Batch:
    """Columns of one batch: tensors with a shared first dimension plus per-row Python values. Runs on: controller and
    workers alike (plain data).

    Args:
        tensors: name -> tensor of shape ``[B, ...]``.
        columns: name -> list of ``B`` Python values (strings, token-id lists, dataset fields).
        meta: batch-level values that are not per row (e.g. ``{"temperature": 1.0}``); kept on split/concat.
    """

    def __init__(
        self,
        tensors: Mapping[str, Tensor] | None = None,
        columns: Mapping[str, Sequence[Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.tensors: dict[str, Tensor] = dict(tensors or {})
        self.columns: dict[str, list[Any]] = {k: list(v) for k, v in (columns or {}).items()}
        self.meta: dict[str, Any] = dict(meta or {})
        sizes = {k: int(v.shape[0]) for k, v in self.tensors.items()} | {k: len(v) for k, v in self.columns.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch columns disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return int(v.shape[0])
        for c in self.columns.values():
            return len(c)
        return 0

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.columns

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors[key]
        if key in self.columns:
            return self.columns[key]
        raise KeyError(f"Batch has no column {key!r}. Columns: {sorted(self.keys())}")

    def __setitem__(self, key: str, value: Tensor | Sequence[Any]) -> None:
        n = len(self)
        size = int(value.shape[0]) if isinstance(value, Tensor) else len(value)
        if self.keys() and size != n:
            raise ValueError(f"Column {key!r} has {size} rows, the batch has {n}")
        self.tensors.pop(key, None)
        self.columns.pop(key, None)
        if isinstance(value, Tensor):
            self.tensors[key] = value
        else:
            self.columns[key] = list(value)

    def keys(self) -> list[str]:
        """Names of all columns, tensors first."""
        return [*self.tensors, *self.columns]

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) for k, v in self.tensors.items()}
        return f"Batch(len={len(self)}, tensors={shapes}, columns={sorted(self.columns)})"

    def select(self, index: Tensor | Sequence[int] | slice) -> Batch:
        """Rows ``index`` of every column (a new batch; tensors are views or copies as torch decides)."""
        if isinstance(index, slice):
            rows = list(range(len(self)))[index]
        else:
            rows = index.tolist() if isinstance(index, Tensor) else list(index)
        idx = torch.as_tensor(rows, dtype=torch.long)
        return Batch(
            {k: v[idx.to(v.device)] for k, v in self.tensors.items()},
            {k: [v[i] for i in rows] for k, v in self.columns.items()},
            self.meta,
        )

    def chunk(self, n: int) -> list[Batch]:
        """Split into ``n`` contiguous equal parts. The batch size must be divisible by ``n``."""
        size = len(self)
        if size % n:
            raise ValueError(f"Cannot split a batch of {size} rows into {n} equal parts")
        step = size // n
        return [self.select(slice(i * step, (i + 1) * step)) for i in range(n)]

    def split(self, size: int) -> Iterator[Batch]:
        """Consecutive parts of ``size`` rows (the last may be shorter)."""
        for start in range(0, len(self), size):
            yield self.select(slice(start, start + size))

    @staticmethod
    def cat(batches: Sequence[Batch]) -> Batch:
        """Concatenate along the batch dimension; tensors whose later dims differ are right-padded with 0."""
        if not batches:
            return Batch()
        first = batches[0]
        tensors = {k: torch.cat(_pad_to_common_shape([b.tensors[k] for b in batches]), dim=0) for k in first.tensors}
        columns = {k: [x for b in batches for x in b.columns[k]] for k in first.columns}
        return Batch(tensors, columns, first.meta)

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor on ``device``."""
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.columns, self.meta)

    def update(self, other: Batch) -> Batch:
        """Add (or overwrite) the columns of ``other``, which must have the same length. Returns self."""
        for k, v in other.tensors.items():
            self[k] = v
        for k, c in other.columns.items():
            self[k] = c
        self.meta.update(other.meta)
        return self


def _pad_to_common_shape(parts: list[Tensor]) -> list[Tensor]:
    """Right-pad every dim after the first to the largest size among ``parts``."""
    if len({p.shape[1:] for p in parts}) == 1:
        return parts
    target = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    out = []
    for p in parts:
        pad: list[int] = []
        for d in reversed(range(1, p.dim())):
            pad += [0, target[d - 1] - p.shape[d]]
        out.append(torch.nn.functional.pad(p, pad))
    return out


def sampled_mask(batch: Batch) -> Tensor:
    """``[B, R]``: the response tokens the policy sampled. A multi-turn episode (:mod:`lightning_rlhf.agents`) sets
    ``sampled_mask`` (its observations, tool results and environment turns, are context the model attends to but did not
    sample); any other rollout: every response token (``response_mask``). Rewards land on, advantages, values and
    probability checks run over, and the loss counts only these tokens. Runs on: any process (pure function)."""
    return batch["sampled_mask"] if "sampled_mask" in batch else batch["response_mask"]
