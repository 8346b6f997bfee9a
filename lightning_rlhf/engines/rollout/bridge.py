"""Weights across pools: a trainer's pool hands its weights to a generation-only pool over collectives.

When the rollout engines live on ranks of their own, the engines' ranks hold no FSDP shards: the trainer's pool
gathers full tensors among its own ranks, and its first rank, the *source*, broadcasts them to every rollout rank
over one process group made at set-up (``{source} + rollout ranks``), in flat buckets in ``named_parameters()``
order, so neither side holds more than one bucket beyond the model. A header goes first (:class:`WeightHeader`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["BRIDGE_BUCKET_BYTES", "WeightBridge", "WeightHeader", "receive_weights", "send_weights"]

BRIDGE_BUCKET_BYTES = 64 * 2**20
"""Bytes per broadcast bucket: large enough that per-call latency is negligible, small enough to stay a sliver of
a multi-billion-parameter model."""


@dataclasses.dataclass(frozen=True)
class WeightBridge:
    """The process group from a trainer pool's first rank (``src``, a global rank) to a rollout pool's ranks: made by
    the strategy at set-up on every rank (``dist.new_group`` is collective over the world), given to both roles."""

    group: Any
    src: int


@dataclasses.dataclass(frozen=True)
class WeightHeader:
    """What the source announces before a hand-off."""

    send: bool
    """Whether tensors follow (False: the receivers keep the weights they have)."""
    version: int
    """The number of optimizer updates behind the weights (the receivers' new version when ``send``)."""
    specs: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Each tensor's name and shape, in the order they come."""
    dtype: str = "float32"
    """The dtype every tensor travels in (the engines' compute dtype)."""
    fingerprints: dict[str, tuple[list[tuple[int, int]], Tensor]] = dataclasses.field(default_factory=dict)
    """Per tensor, the fingerprint the receivers' engines must hold after this hand-off (empty: not checked; see
    :func:`~lightning_rlhf.engines.rollout.reshard.shard_fingerprints`)."""


def _bucket_plan(specs: Iterable[tuple[str, tuple[int, ...]]], itemsize: int, bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensor indices per bucket: a bucket closes before it would exceed ``bucket_bytes`` (a larger
    tensor travels alone). Both sides compute the same plan from the header."""
    plan: list[list[int]] = []
    size = 0
    for i, (_, shape) in enumerate(specs):
        nbytes = int(torch.Size(shape).numel()) * itemsize
        if not plan or (size + nbytes > bucket_bytes and plan[-1]):
            plan.append([])
            size = 0
        plan[-1].append(i)
        size += nbytes
    return plan


def _broadcast_header(bridge: WeightBridge, header: WeightHeader | None) -> WeightHeader:
    """The source's header on every member of the bridge (``header`` is the source's; None elsewhere)."""
    box = [header]
    dist.broadcast_object_list(box, src=bridge.src, group=bridge.group)
    assert isinstance(box[0], WeightHeader)
    return box[0]


def send_weights(
    bridge: WeightBridge,
    header: WeightHeader,
    tensors: Iterable[tuple[str, Tensor]],
    *,
    bucket_bytes: int = BRIDGE_BUCKET_BYTES,
) -> int:
    """Broadcast ``header``, then (when ``header.send``) ``tensors``, which must yield exactly ``header.specs`` in
    order, in buckets; returns the bytes sent. Runs on: the source rank only (the other ranks of its pool only feed
    ``tensors``' gathers)."""
    _broadcast_header(bridge, header)
    if not header.send:
        return 0
    dtype = getattr(torch, header.dtype)
    stream = iter(tensors)
    sent = 0
    for indices in _bucket_plan(header.specs, dtype.itemsize, bucket_bytes):
        parts = []
        for i in indices:
            name, tensor = next(stream)
            expected = header.specs[i]
            if name != expected[0] or tuple(tensor.shape) != expected[1]:
                raise RuntimeError(
                    f"send_weights: tensor {i} is {name!r} {tuple(tensor.shape)}, the header announced {expected}."
                )
            parts.append(tensor.detach().to(dtype).reshape(-1))
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
        dist.broadcast(flat, src=bridge.src, group=bridge.group)
        sent += flat.numel() * flat.element_size()
    return sent


def receive_weights(
    bridge: WeightBridge, device: torch.device, *, bucket_bytes: int = BRIDGE_BUCKET_BYTES
) -> tuple[WeightHeader, Iterator[tuple[str, Tensor]]]:
    """The header the source broadcast, and (when it sends) the stream of ``(name, tensor)`` to load, received one
    bucket at a time as it is read. Runs on: every receiving rank; the stream must be read to its end (each bucket is
    a collective)."""
    header = _broadcast_header(bridge, None)

    def stream() -> Iterator[tuple[str, Tensor]]:
        dtype = getattr(torch, header.dtype)
        for indices in _bucket_plan(header.specs, dtype.itemsize, bucket_bytes):
            shapes = [torch.Size(header.specs[i][1]) for i in indices]
            flat = torch.empty(sum(s.numel() for s in shapes), dtype=dtype, device=device)
            dist.broadcast(flat, src=bridge.src, group=bridge.group)
            offset = 0
            for i, shape in zip(indices, shapes, strict=True):
                yield header.specs[i][0], flat[offset : offset + shape.numel()].view(shape)
                offset += shape.numel()

    return header, (stream() if header.send else iter(()))
