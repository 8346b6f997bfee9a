"""FSDP2 for transformers models: shard, clip gradients, and stream full weights out.

The order of wrapping matters: each decoder layer becomes its own FSDP unit (so only one layer's full
weights exist at a time in forward and backward), then the model root picks up what is left (embeddings,
final norm, head; tied embeddings stay one parameter).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

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


def full_tensors(model: nn.Module, received: list[int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` per parameter, one at a time (never the whole model at once).

    Runs on: every worker rank, in the same order (each ``full_tensor`` is an all-gather). When ``received`` is
    given, ``received[0]`` grows by the bytes this rank gets from the others.
    """
    for name, param in model.named_parameters():
        data = param.data
        if isinstance(data, DTensor):
            local = data.to_local()
            data = data.full_tensor()
            if received is not None:
                received[0] += (data.numel() - local.numel()) * data.element_size()
        yield name, data


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every tensor of the optimizer's state (e.g. Adam moments) to ``device``, in place.

    Runs on: every worker rank (local shards only, no collective). Used to free accelerator memory for the
    rollout engine while it generates.
    """
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":
                state[key] = value.to(device, non_blocking=True)
