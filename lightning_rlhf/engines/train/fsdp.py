"""FSDP2 for transformers models: shard, clip gradients, and stream full weights out.

The order of wrapping matters: each decoder layer becomes its own FSDP unit (so only one layer's full
weights exist at a time in forward and backward), then the model root picks up what is left (embeddings,
final norm, head; tied embeddings stay one parameter).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

__all__ = ["clip_grad_norm", "full_tensors", "move_optimizer_state", "shard_model"]


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks named in transformers' ``_no_split_modules`` (e.g. ``Qwen2DecoderLayer``)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:  # not a transformers model: fall back to the children of the first ModuleList
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        layers = list(lists[0]) if lists else []
    return layers


def shard_model(model: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype | None = None) -> nn.Module:
    """Apply FSDP2 (``fully_shard``) per decoder layer, then to the root. In place; returns ``model``.

    Runs on: every worker rank (collective-free, but all ranks must shard the same way).

    Args:
        model: a transformers model (causal LM, token- or sequence-classifier).
        mesh: the 1-D data-parallel device mesh.
        param_dtype: compute dtype for forward/backward (e.g. ``torch.bfloat16``); gradients are reduced in
            float32. None keeps the model's dtype.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global gradient norm over all ranks, clipping to ``max_norm`` when it is > 0 and finite.

    Runs on: every worker rank (a collective when the gradients are sharded). Returns the norm before clipping.
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0 and torch.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


GATHER_BUCKET_BYTES = 64 << 20
"""Bytes of local shards gathered by one collective in :func:`full_tensors` (the full bucket then takes this
times the world size, transiently)."""


def full_tensors(
    model: nn.Module,
    received: list[int] | None = None,
    *,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = GATHER_BUCKET_BYTES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` per parameter, in ``named_parameters()`` order; the whole model is never
    assembled at once.

    Runs on: every worker rank, in the same order (the gathers are collectives). Row-sharded parameters (FSDP2's
    ``Shard(0)``) are gathered a bucket at a time: the local shards of consecutive parameters, up to
    ``bucket_bytes``, go in one ``all_gather_into_tensor`` (one collective per bucket instead of one per
    parameter: on gloo that is most of a small model's hand-off). Other DTensors are gathered one by one
    (``full_tensor``). With ``dtype`` the shards are cast before they are sent (e.g. to a bfloat16 engine: half
    the bytes). When ``received`` is given, ``received[0]`` grows by the bytes this rank gets from the others.
    """
    bucket: list[tuple[str, DTensor]] = []
    size = 0
    for name, param in model.named_parameters():
        data = param.data
        if not isinstance(data, DTensor) or not _row_sharded(data):
            yield from _gather_bucket(bucket, received, dtype)
            bucket, size = [], 0
            if isinstance(data, DTensor):
                local = data.to_local()
                data = data.full_tensor()
                if received is not None:
                    received[0] += (data.numel() - local.numel()) * data.element_size()
            yield name, data if dtype is None else data.to(dtype)
            continue
        nbytes = _chunk_rows(data)[0] * _row_numel(data) * (dtype or data.dtype).itemsize
        if bucket and (size + nbytes > bucket_bytes or (dtype is None and bucket[0][1].dtype != data.dtype)):
            yield from _gather_bucket(bucket, received, dtype)
            bucket, size = [], 0
        bucket.append((name, data))
        size += nbytes
    yield from _gather_bucket(bucket, received, dtype)


def _row_sharded(data: DTensor) -> bool:
    """A 1-D mesh, ``Shard(0)``, and a local shard of exactly the rows ``torch.chunk`` gives this rank."""
    if data.device_mesh.ndim != 1 or tuple(data.placements) != (Shard(0),) or data.dim() == 0:
        return False
    local = data.to_local()
    return local.shape[0] == _chunk_rows(data)[1] and local.is_contiguous()


def _chunk_rows(data: DTensor) -> tuple[int, int]:
    """``(rows per chunk, rows on this rank)`` of FSDP2's ``torch.chunk`` split of dim 0."""
    world = data.device_mesh.size()
    rank = data.device_mesh.get_local_rank()
    chunk = -(-data.shape[0] // world)
    return chunk, max(0, min(data.shape[0], (rank + 1) * chunk) - rank * chunk)


def _row_numel(data: DTensor) -> int:
    return math.prod(data.shape[1:])


def _gather_bucket(
    bucket: list[tuple[str, DTensor]], received: list[int] | None, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """One ``all_gather_into_tensor`` of the bucket's local shards (each padded to its chunk), then each full
    tensor cut out of the rank-major result."""
    if not bucket:
        return
    first = bucket[0][1]
    mesh = first.device_mesh
    world = mesh.size()
    out_dtype = dtype or first.dtype
    sizes = [_chunk_rows(d)[0] * _row_numel(d) for _, d in bucket]
    total = sum(sizes)
    flat = torch.zeros(total, dtype=out_dtype, device=first.to_local().device)
    offset = 0
    for (_, data), chunk in zip(bucket, sizes, strict=True):
        local = data.to_local().reshape(-1)
        flat[offset : offset + local.numel()].copy_(local)
        offset += chunk
    gathered = torch.empty(world * total, dtype=out_dtype, device=flat.device)
    dist.all_gather_into_tensor(gathered, flat, group=mesh.get_group())
    by_rank = gathered.view(world, total)
    offset = 0
    for (name, data), chunk in zip(bucket, sizes, strict=True):
        rows, row_numel = data.shape[0], _row_numel(data)
        per_rank = -(-rows // world)
        pieces = [
            by_rank[r, offset : offset + max(0, min(rows, (r + 1) * per_rank) - r * per_rank) * row_numel]
            for r in range(world)
        ]
        full = torch.cat(pieces).view(data.shape)
        if received is not None:
            received[0] += (full.numel() - data.to_local().numel()) * full.element_size()
        offset += chunk
        yield name, full


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every tensor of the optimizer's state (e.g. Adam moments) to ``device``, in place.

    Runs on: every worker rank (local shards only, no collective). Used to free accelerator memory for the
    rollout engine while it generates.
    """
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
