"""FSDP2 for transformers models: shard, clip gradients, and stream full weights out.

The order of wrapping matters: each decoder layer becomes its own FSDP unit (so only one layer's full
weights exist at a time in forward and backward), then the model root picks up what is left (embeddings,
final norm, head; tied embeddings stay one parameter).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from lightning_rlhf.compat.sharding import RowShard, row_shard
from lightning_rlhf.compat.transformers import no_split_modules
from lightning_rlhf.engines.device_layer import PLAIN, DeviceLayer, HostBuffer

__all__ = [
    "clip_grad_norm",
    "full_tensors",
    "move_optimizer_state",
    "shard_model",
]


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks named in transformers' ``_no_split_modules`` (e.g. ``Qwen2DecoderLayer``)."""
    names = no_split_modules(model)
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:  # not a transformers model: fall back to the children of the first ModuleList
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        layers = list(lists[0]) if lists else []
    return layers


def shard_model(
    model: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype | None = None, layer: DeviceLayer = PLAIN
) -> nn.Module:
    """Apply FSDP2 (``fully_shard``) per decoder layer, then to the root, over the 1-D data-parallel ``mesh``. In
    place; returns ``model``. ``param_dtype``: the compute dtype (gradients are reduced in float32; None keeps the
    model's). On CPU the units' collectives are the ``layer``'s. Each unit returns no view that requires a gradient
    (:func:`_clone_view_outputs`), so its pre-backward hook cannot be detached.

    Runs on: every worker rank (collective-free, but all ranks must shard the same way).
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for unit in [*_decoder_layers(model), model]:
        fully_shard(unit, mesh=mesh, mp_policy=mp)
        unit.register_forward_hook(_clone_view_outputs, prepend=True)  # before FSDP2's own: see its docstring
    if mesh.device_type == "cpu":
        layer.fsdp_collectives(model)
    return model


def _clone_view_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    """Forward hook of every FSDP unit, run just before FSDP2's post-forward hook (which registers the unit's
    pre-backward hook on each output that requires a gradient): such an output that is a view is replaced by a copy.

    Runs on: worker (inside the unit's forward, with gradients enabled). An in-place op on a returned view would
    detach FSDP2's hook from the graph (and FSDP2 warns about every such output). On the default path nothing is
    copied but a critic's small ``[B, T, 1]`` value head (``F.linear`` with a bias on a 3-D input returns a view).
    """
    if not torch.is_grad_enabled():
        return None
    return _cloned_views(output)


def _cloned_views(value: Any) -> Any:
    """``value`` with every gradient-requiring view tensor in it cloned: tensors, dicts (transformers' ``ModelOutput``
    is one, updated in place), lists and tuples; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.requires_grad and value._base is not None else value
    if isinstance(value, dict):
        for key, item in list(value.items()):
            new = _cloned_views(item)
            if new is not item:
                value[key] = new
        return value
    if type(value) in (list, tuple):
        items = [_cloned_views(item) for item in value]
        return value if all(a is b for a, b in zip(items, value, strict=True)) else type(value)(items)
    return value


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global gradient norm over all ranks (returned, before clipping), clipping to ``max_norm`` when it is > 0 and
    finite. Runs on: every worker rank (a collective when the gradients are sharded)."""
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
    transport: str = "auto",
    views: bool = False,
    layer: DeviceLayer = PLAIN,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` per parameter, in ``named_parameters()`` order; the whole model is never
    assembled at once.

    Runs on: every worker rank, in the same order (the gathers are collectives). Row-sharded parameters go a bucket
    of up to ``bucket_bytes`` at a time (one exchange per parameter was most of a small model's hand-off on gloo).
    With ``dtype`` the shards are cast before they are sent. ``received[0]`` grows by the bytes from the others.

    Args:
        transport: how a bucket moves. ``"collective"``: one ``all_gather_into_tensor``. ``"shared"``: through
            the ``layer``'s host buffer (each rank writes its rows into place, one barrier); raises when there is
            none. ``"auto"``: shared for CPU tensors where the layer has a buffer, else collective.
        views: the consumer copies each tensor before it takes the next one, so the shared transport may yield views
            of its buffer (valid until the next bucket).

    Raises:
        ValueError: an unknown ``transport``.
    """
    if transport not in ("auto", "shared", "collective"):  # checked at the call, before any rank starts exchanging
        raise ValueError(f"full_tensors: transport={transport!r}; use 'auto', 'shared' or 'collective'")
    return _full_tensors(model, received, dtype, bucket_bytes, transport, views, layer)


def _full_tensors(
    model: nn.Module,
    received: list[int] | None,
    dtype: torch.dtype | None,
    bucket_bytes: int,
    transport: str,
    views: bool,
    layer: DeviceLayer,
) -> Iterator[tuple[str, torch.Tensor]]:
    with torch.no_grad():  # the plan reads local shards: no autograd records (and it is 2x faster)
        plan = list(_plan(model, dtype, bucket_bytes))
    buckets = [item for item in plan if isinstance(item, list)]
    buffer = _shared_buffer(buckets, dtype, transport, layer)
    for item in plan:
        if isinstance(item, list):
            if buffer is not None:
                yield from _share_bucket(item, received, dtype, buffer, views)
            else:
                yield from _gather_bucket(item, received, dtype)
            continue
        name, data = item
        data = whole(data, received)
        yield name, data if dtype is None else data.to(dtype)


def whole(data: torch.Tensor, received: list[int] | None) -> torch.Tensor:
    """``data`` whole (a DTensor's ``full_tensor()``, gathered: ``received[0]`` grows by the bytes the other ranks
    sent). Runs on: every rank of a DTensor's mesh together."""
    if isinstance(data, DTensor):
        local = data.to_local()
        data = data.full_tensor()
        if received is not None:
            received[0] += (data.numel() - local.numel()) * data.element_size()
    return data


_Item = tuple[str, torch.Tensor] | list[RowShard]


def _plan(model: nn.Module, dtype: torch.dtype | None, bucket_bytes: int) -> Iterator[_Item]:
    """The hand-off's steps in order: a bucket of row-sharded parameters (a list), or one other ``(name, tensor)``."""
    positions: dict[int, tuple[dist.ProcessGroup, int, int]] = {}  # per mesh: (group, size, rank); asking is slow
    bucket: list[RowShard] = []
    size = 0
    for name, param in model.named_parameters():
        shard = row_shard(name, param, positions)
        if shard is None:
            if bucket:
                yield bucket
            bucket, size = [], 0
            yield name, param.data
            continue
        nbytes = shard.chunk_rows * shard.row_numel * (dtype or shard.local.dtype).itemsize
        if bucket and (
            size + nbytes > bucket_bytes
            or (dtype is None and bucket[0].local.dtype != shard.local.dtype)
            or bucket[0].group is not shard.group
        ):
            yield bucket
            bucket, size = [], 0
        bucket.append(shard)
        size += nbytes
    if bucket:
        yield bucket


def _shared_buffer(
    buckets: list[list[RowShard]], dtype: torch.dtype | None, transport: str, layer: DeviceLayer
) -> HostBuffer | None:
    """The host buffer the buckets go through, or None for the collective (see ``full_tensors``' transport)."""
    if transport == "collective" or not buckets:
        return None
    first = buckets[0][0]
    if first.local.device.type != "cpu":
        if transport == "shared":
            raise ValueError("full_tensors: transport='shared' needs CPU tensors. HINT: transport='auto'.")
        return None
    if any(bucket[0].group is not first.group for bucket in buckets):  # several meshes: not what the trainer makes
        if transport == "shared":
            raise ValueError("full_tensors: transport='shared' needs every parameter on one mesh. HINT: 'auto'.")
        return None
    need = max(sum(s.shape.numel() * (dtype or s.local.dtype).itemsize for s in bucket) for bucket in buckets)
    buffer = layer.host_buffer(first.group, need)
    if buffer is None and transport == "shared":
        raise RuntimeError(
            f"full_tensors: transport='shared' but the device layer ({layer.name!r}) gave no shared-memory buffer: "
            "its hand-off piece is off (RLHFStrategy(cpu_kernels=False), LIGHTNING_RLHF_CPU_KERNELS=0 or "
            "LIGHTNING_RLHF_CPU_OFF=hand_off), or the ranks cannot map one file (other hosts, no room in /dev/shm). "
            "HINT: transport='auto' falls back to the collective."
        )
    return buffer


def _share_bucket(
    bucket: list[RowShard], received: list[int] | None, dtype: torch.dtype | None, buffer: HostBuffer, views: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each rank writes its rows of the bucket's parameters into place in the buffer's next half (cast on the way),
    one barrier, then each full tensor is read where it lies."""
    out_dtype = dtype or bucket[0].local.dtype
    numels = [s.shape.numel() for s in bucket]
    flat = buffer.next_half(sum(numels) * out_dtype.itemsize).view(out_dtype)
    offset = 0
    for shard, numel in zip(bucket, numels, strict=True):
        local = shard.local
        if local.numel():
            start = offset + shard.rank * shard.chunk_rows * shard.row_numel
            flat[start : start + local.numel()].view(local.shape).copy_(local)
        offset += numel
    buffer.barrier()
    offset = 0
    for shard, numel in zip(bucket, numels, strict=True):
        full = flat[offset : offset + numel].view(shard.shape)
        if received is not None:
            received[0] += (numel - shard.local.numel()) * full.element_size()
        offset += numel
        yield shard.name, full if views else full.clone()


def _gather_bucket(
    bucket: list[RowShard], received: list[int] | None, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """One ``all_gather_into_tensor`` of the bucket's local shards (each padded to its chunk), then each full
    tensor cut out of the rank-major result."""
    first = bucket[0]
    world = first.world
    out_dtype = dtype or first.local.dtype
    sizes = [s.chunk_rows * s.row_numel for s in bucket]
    total = sum(sizes)
    flat = torch.zeros(total, dtype=out_dtype, device=first.local.device)
    offset = 0
    for shard, chunk in zip(bucket, sizes, strict=True):
        local = shard.local.reshape(-1)
        flat[offset : offset + local.numel()].copy_(local)
        offset += chunk
    gathered = torch.empty(world * total, dtype=out_dtype, device=flat.device)
    dist.all_gather_into_tensor(gathered, flat, group=first.group)
    by_rank = gathered.view(world, total)
    offset = 0
    for shard, chunk in zip(bucket, sizes, strict=True):
        pieces = [by_rank[r, offset : offset + shard.rows_of(r) * shard.row_numel] for r in range(world)]
        full = torch.cat(pieces).view(shard.shape)
        if received is not None:
            received[0] += (full.numel() - shard.local.numel()) * full.element_size()
        offset += chunk
        yield shard.name, full


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every tensor of the optimizer's state (e.g. Adam moments) to ``device``, in place. Runs on: every worker
    rank (local shards only, no collective)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
