"""FSDP2 -> tensor-parallel resharding: each rank receives only the slice of each tensor its TP shard needs
(docs/hybrid-engine.md, "Each rank receives only its TP slices").

Per parameter, in the same order on every rank: :func:`tp_slice` says which region of the full tensor TP rank ``r``
loads (vLLM's loaders' rules, Llama/Qwen2/Qwen3/Mistral naming; anything else: whole); :func:`exchange` sends each
rank that region's rows and columns from the others' FSDP rows in one ``all_to_all_single`` (row-sliced tensors,
q/k/v/gate/up and the vocabulary rows, mostly do not move); and a :class:`SliceHolder` stands in for the full tensor
vLLM's loaders expect, answering exactly the ``narrow`` the loader will ask for, so that a loader whose slicing
differs fails loudly instead of loading wrong values.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from lightning_rlhf.engines.device_layer import PLAIN, DeviceLayer
from lightning_rlhf.engines.rollout.base import (
    Fingerprint,
    RolloutEngine,
    RowRanges,
    Slicer,
    TPSlice,
    as_rows,
    fingerprint_ranges,
    part_sums,
    range_pieces,
)

__all__ = [
    "SliceHolder",
    "TPSlice",
    "exchange",
    "shard_fingerprints",
    "sliced_tensors",
    "tp_slice",
    "tp_slicer",
    "weights_for",
]

VOCAB_PADDING = 64
"""vLLM pads the vocabulary to a multiple of 64 before splitting it over TP ranks."""

_SUPPORTED = ("llama", "qwen2", "qwen3", "mistral")


def tp_slice(name: str, shape: tuple[int, ...], *, config: Any, tp_size: int, tp_rank: int) -> TPSlice | None:
    """The region of ``name`` (full ``shape``) that vLLM's loader on TP rank ``tp_rank`` keeps; None = all. Runs on:
    any process (pure)."""
    if tp_size == 1:
        return None
    parts = name.split(".")
    module, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    if module == "q_proj":
        rows = heads * head_dim // tp_size
        return TPSlice(0, tp_rank * rows, rows)
    if module in ("k_proj", "v_proj"):
        if kv_heads >= tp_size:
            rows = kv_heads * head_dim // tp_size
            return TPSlice(0, tp_rank * rows, rows)
        head = tp_rank // (tp_size // kv_heads)  # replicated KV heads: one head per rank
        return TPSlice(0, head * head_dim, head_dim)
    if module in ("gate_proj", "up_proj"):
        rows = shape[0] // tp_size
        return TPSlice(0, tp_rank * rows, rows)
    if module in ("o_proj", "down_proj") and kind == "weight":
        cols = shape[1] // tp_size
        return TPSlice(1, tp_rank * cols, cols)
    if module in ("embed_tokens", "lm_head") and kind == "weight":
        vocab = shape[0]
        per_rank = math.ceil(vocab / VOCAB_PADDING) * VOCAB_PADDING // tp_size
        start = min(tp_rank * per_rank, vocab)
        return TPSlice(0, start, min(start + per_rank, vocab) - start)
    return None


def tp_slicer(config: Any, tp_size: int) -> Slicer | None:
    """A :data:`Slicer` for this model, or None when its architecture is not covered (whole tensors then). Runs on:
    any process."""
    if tp_size == 1 or getattr(config, "model_type", None) not in _SUPPORTED:
        return None
    return lambda name, shape, tp_rank: tp_slice(name, shape, config=config, tp_size=tp_size, tp_rank=tp_rank)


class SliceHolder(torch.Tensor):
    """Stands in for a full tensor of which only ``region`` is held; answers only ``narrow(region)`` (vLLM's
    parameter loaders ``narrow`` the full checkpoint tensor to their TP slice)."""

    _held: Tensor
    _region: TPSlice

    @staticmethod
    def __new__(cls, held: Tensor, full_shape: tuple[int, ...], region: TPSlice) -> SliceHolder:
        self = torch.Tensor._make_wrapper_subclass(cls, full_shape, dtype=held.dtype, device=held.device)
        self._held = held
        self._region = region
        return self

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.Tensor.narrow, torch.narrow):
            holder, dim, start, length = (*args, *kwargs.values())[:4]
            region = holder._region
            dim = dim % holder.dim()
            if (dim, int(start), int(length)) != (region.dim, region.start, region.length):
                raise RuntimeError(
                    f"vLLM's loader asked for narrow(dim={dim}, start={start}, length={length}) but the resharded "
                    f"weight holds {region}. HINT: VLLMConfig(weight_transfer='full') for this model, and report it."
                )
            return holder._held
        name = getattr(func, "__name__", "")
        if name in ("__get__", "dim", "size", "numel", "__len__") or func in (torch.Tensor.dim, torch.Tensor.size):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise RuntimeError(
            f"vLLM's loader used {name or func} on a resharded weight, which only supports narrow(). HINT: "
            "VLLMConfig(weight_transfer='full') for this model, and report it."
        )

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        raise RuntimeError(f"SliceHolder supports narrow() only, not {func}")

    @property
    def held_bytes(self) -> int:
        """Bytes actually held (the slice)."""
        return self._held.numel() * self._held.element_size()


def _local_rows(param: Tensor, rank: int, world: int) -> tuple[Tensor, int, int]:
    """This rank's FSDP2 rows ``(local tensor, first row, row count)``; a plain tensor holds them all."""
    if not isinstance(param, DTensor):
        return param, 0, param.shape[0] if param.dim() else 1
    if tuple(param.placements) != (Shard(0),):
        raise ValueError(f"resharding expects FSDP2 Shard(0) parameters, got {param.placements}")
    rows = param.shape[0]
    chunk = math.ceil(rows / world)
    start = min(rank * chunk, rows)
    return param.to_local(), start, min(start + chunk, rows) - start


def _block(local: Tensor, first: int, count: int, need: TPSlice | None) -> Tensor:
    """The part of ``local`` (full rows ``[first, first+count)``) inside region ``need``."""
    if need is None:
        return local
    if need.dim == 0:
        lo, hi = max(first, need.start), min(first + count, need.start + need.length)
        return local[max(0, lo - first) : max(0, hi - first)]
    return local[:, need.start : need.start + need.length]


def _in_own_rows(need: TPSlice | None, rank: int, chunk: int, rows: int) -> bool:
    """Whether region ``need`` is a block of rows inside FSDP2 rank ``rank``'s rows (``chunk`` a rank, ``rows`` in
    all)."""
    first = min(rank * chunk, rows)
    last = min(first + chunk, rows)
    return need is not None and need.dim == 0 and first <= need.start and need.start + need.length <= last


def exchange(param: Tensor, needs: list[TPSlice | None], *, dtype: torch.dtype | None = None) -> tuple[Tensor, int]:
    """Give each rank ``d`` the region ``needs[d]`` of the full tensor behind ``param`` (an FSDP2 DTensor); returns
    ``(this rank's region, bytes received from other ranks)``. Where every rank's region lies in its own FSDP2 rows
    (q/k/v, gate/up and the vocabulary when the TP and FSDP2 groups are the same ranks) nothing moves: the region is
    a view of this rank's shard (cast to ``dtype`` where it differs), which the caller must not keep past the next
    update. Runs on: every worker rank, collectively (the same decision on every rank, from the shapes alone)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    local, first, count = _local_rows(param.data, rank, world)
    full_shape = tuple(param.shape)
    trailing = full_shape[1:]
    # What every source rank sends to every destination: known everywhere from the shapes alone.
    chunk = math.ceil(full_shape[0] / world) if full_shape else 1
    if full_shape and all(_in_own_rows(needs[d], d, chunk, full_shape[0]) for d in range(world)):
        mine = needs[rank]
        assert mine is not None
        region = local[mine.start - first : mine.start - first + mine.length]
        return (region if dtype is None else region.to(dtype)), 0
    if dtype is not None:
        local = local.to(dtype)

    def block_shape(src: int) -> tuple[int, ...]:  # _block of a meta tensor of the source's rows
        s_first = min(src * chunk, full_shape[0])
        s_count = min(s_first + chunk, full_shape[0]) - s_first
        return tuple(_block(torch.empty(s_count, *trailing, device="meta"), s_first, s_count, needs[rank]).shape)

    send = [_block(local, first, count, needs[d]).contiguous() for d in range(world)]
    recv_shapes = [block_shape(s) for s in range(world)]
    recv_sizes = [math.prod(s) for s in recv_shapes]
    out = torch.empty(sum(recv_sizes), dtype=local.dtype, device=local.device)
    dist.all_to_all_single(
        out,
        torch.cat([t.reshape(-1) for t in send]),
        output_split_sizes=recv_sizes,
        input_split_sizes=[t.numel() for t in send],
    )
    blocks = [b.reshape(s) for b, s in zip(out.split(recv_sizes), recv_shapes, strict=True)]
    region = torch.cat(blocks, dim=0)  # row blocks arrive in source-rank order, which is row order
    received = sum(recv_sizes) - recv_sizes[rank]
    return region, received * local.element_size()


def sliced_tensors(
    model: nn.Module, slicer: Slicer, *, tp_size: int, received: list[int] | None = None, dtype: torch.dtype
) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(name, weight)`` per parameter for this rank's TP engine: a :class:`SliceHolder` where TP slices
    the tensor (holding a view of this rank's shard where the slice lies in its rows: :func:`exchange`), the full
    tensor where it is replicated; ``received[0]`` grows by the bytes this rank receives from the others. Runs on:
    every worker rank, in the same order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for name, param in model.named_parameters():
        shape = tuple(param.shape)
        needs = [slicer(name, shape, d % tp_size) for d in range(world)]
        if not shape:  # a scalar: every rank has it whole
            region, got = param.data.full_tensor() if isinstance(param.data, DTensor) else param.data, 0
        else:
            region, got = exchange(param, needs, dtype=dtype)
        if received is not None:
            received[0] += got
        mine = needs[rank]
        yield name, region if mine is None else SliceHolder(region, shape, mine)


def weights_for(
    engine: RolloutEngine,
    model: nn.Module,
    received: list[int] | None = None,
    *,
    transport: str = "auto",
    into_engine: bool = False,
    layer: DeviceLayer = PLAIN,
) -> Iterator[tuple[str, Tensor]]:
    """The weight stream ``engine.load_weights`` should get from the FSDP2 ``model``: only this rank's TP slices
    when the engine has a ``slicer`` (vLLM at TP > 1), else full tensors; a LoRA model's merged weights
    (:func:`~lightning_rlhf.engines.train.lora.merged_weights`, full tensors for any engine). Runs on: every worker
    rank.

    ``transport``: how full tensors move (``full_tensors``'s), through ``layer``'s host buffer for ``"shared"``.
    ``into_engine=True``: the stream goes straight into ``engine.load_weights``, so an engine that copies each tensor
    before it takes the next (``engine.abilities.copies_each_weight``) may get views of the shared buffer, which
    later buckets overwrite; any other use gets full tensors of its own. TP slices already in a rank's rows are views
    of its shards in either case (valid until the next update).
    """
    from lightning_rlhf.engines.train import full_tensors
    from lightning_rlhf.engines.train.lora import has_lora, merged_weights

    if has_lora(model):  # LoRA: the base's names, each adapted weight merged on the fly (full tensors, float32)
        return merged_weights(model, full_tensors(model, received, transport=transport, layer=layer), engine.dtype)
    if engine.slicer is None:
        views = into_engine and engine.abilities.copies_each_weight
        return full_tensors(model, received, dtype=engine.dtype, transport=transport, views=views, layer=layer)
    return sliced_tensors(model, engine.slicer, tp_size=engine.tp_size, received=received, dtype=engine.dtype)


@torch.no_grad()
def shard_fingerprints(
    model: nn.Module, *, dtype: torch.dtype, slicer: Slicer | None = None, tp_size: int = 1, tp_rank: int | None = None
) -> dict[str, Fingerprint]:
    """The trainer's side of a verified hand-off, from this rank's FSDP2 rows alone (no collective for a row-sharded
    parameter): per parameter, the rows :func:`~lightning_rlhf.engines.rollout.base.fingerprint_ranges` picks of
    the tensor this rank's engine holds (with a ``slicer``: its TP rank's slice, in its own row numbers) that lie in
    this rank's shard, and their float64 sums in ``dtype``, then the sums of their absolute values. ``tp_rank``: the
    engine's (``RolloutEngine.tp_rank``; None: this rank's in the world, modulo ``tp_size``).

    Runs on: every worker rank of the model's mesh, at the same point (a parameter that is not row-sharded is made
    whole: a collective).
    """
    from lightning_rlhf.compat.sharding import row_shard

    positions: dict[int, tuple[Any, int, int]] = {}
    if tp_rank is None:
        tp_rank = (dist.get_rank() if dist.is_initialized() else 0) % tp_size
    ranges: dict[str, RowRanges] = {}
    pieces: list[Tensor] = []
    lengths: list[int] = []
    for name, param in model.named_parameters():
        shape, data = tuple(param.shape), param  # read under no_grad: a DTensor's detach costs a dispatch per tensor
        shard = row_shard(name, data, positions)
        if shard is not None:
            rows, first = as_rows(shard.local), shard.rank * shard.chunk_rows
        else:  # not row-sharded: made whole (a collective for a DTensor)
            rows, first = as_rows(data.full_tensor() if isinstance(data, DTensor) else data), 0
        region = slicer(name, shape, tp_rank) if slicer is not None and shape else None
        start, count = 0, shape[0] if shape else 1
        if region is not None and region.dim == 1:  # a column block (a row-parallel layer's weight)
            rows = rows[:, region.start : region.start + region.length]
        elif region is not None:
            start, count = region.start, region.length
        lo, hi = max(start, first), min(start + count, first + len(rows))  # this rank's rows of the region
        mine = fingerprint_ranges(lo - start, hi - start, one_dim=rows.shape[1] == 1)
        ranges[name] = mine
        got = range_pieces(rows, mine, start - first)
        pieces += got[0]
        lengths += got[1]
    values, scales = part_sums(pieces, lengths, dtype, with_scale=True).split(len(lengths))
    counts = [len(r) for r in ranges.values()]
    return {
        name: (rows, torch.cat([v, s]))
        for (name, rows), v, s in zip(ranges.items(), values.split(counts), scales.split(counts), strict=True)
    }
