"""The one place where the package touches PyTorch's private state (FSDP2, DTensor, ``nn.Module`` internals).

Each access is a small named function saying what it relies on; ``tests/unit/test_torch_compat.py`` checks each
one against the installed PyTorch, so an upgrade that moves a private name fails there, not in a training run.
``pyproject.toml`` caps torch below the next minor release for the same reason (the pattern of
:mod:`lightning_rlhf.compat.lightning` for Lightning's internals). CPU-only private operators (oneDNN's) live in
:mod:`lightning_rlhf.cpu.onednn`, each behind a named function of the same kind.

A leaf of the package: it imports nothing of it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "SUPPORTED_TORCH",
    "fsdp_params",
    "local_shape_and_offset",
    "local_tensor",
    "put_buffer",
    "put_parameter",
    "set_local_tensor",
    "sharded_param_data",
]

SUPPORTED_TORCH = ">=2.6,<2.14"
"""The PyTorch versions this module is written (and tested) against; ``pyproject.toml`` states the same range."""


def local_tensor(data: torch.Tensor) -> torch.Tensor:
    """The DTensor's local shard (any other tensor: itself), without autograd. Relies on: ``DTensor._local_tensor``
    (private attribute holding the local shard). ``to_local()`` is an autograd function (~15 us a call, most of a small
    model's hand-off plan); read without gradients, the DTensor's own ``_local_tensor`` is the same tensor. Falls back
    to ``to_local()`` where the attribute is gone. Runs on: every rank (weight hand-off, CPU optimizer).
    """
    local = getattr(data, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local
    return data.to_local() if isinstance(data, DTensor) else data


def set_local_tensor(param: torch.Tensor, local: torch.Tensor) -> None:
    """Make ``local`` the local shard of the DTensor ``param`` (FSDP2 then needs ``FSDPParam.reset_sharded_param``).
    Relies on: ``DTensor._local_tensor`` being the attribute the DTensor reads its shard from (no public setter). Runs
    on: every worker rank of the model's mesh (the CPU layer's shared weights).
    """
    param._local_tensor = local  # type: ignore[attr-defined]


def fsdp_params(module: nn.Module) -> list[Any]:
    """The ``FSDPParam`` objects (one per sharded parameter) that the FSDP2 module ``module`` manages itself. Relies on:
    ``FSDPModule._get_fsdp_state()`` and its state's ``_fsdp_param_groups`` (torch >= 2.10: a list), or
    ``_fsdp_param_group`` (earlier releases: one group or None), each group's ``fsdp_params``. Runs on: every worker
    rank of the model's mesh.
    """
    state = module._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch releases with one group per module
        groups = [state._fsdp_param_group] if state._fsdp_param_group is not None else []
    return [unit for group in groups for unit in group.fsdp_params]


def sharded_param_data(fsdp_param: Any) -> torch.Tensor:
    """FSDP2's own flat view of a parameter's local shard (what its all-gathers read). Relies on:
    ``FSDPParam._sharded_param_data``. Runs on: every worker rank of the model's mesh.
    """
    data: torch.Tensor = fsdp_param._sharded_param_data
    return data


def local_shape_and_offset(param: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, global offset)`` of this rank's part of ``param`` under its mesh and placements. Relies on:
    ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset(shape, mesh, placements)``. Runs on: every
    rank holding ``param``.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(shape), tuple(offset)


def put_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Put ``param`` in ``module``'s slot ``name`` (which holds a parameter) without ``register_parameter``. Relies on:
    ``nn.Module._parameters`` (the dict the module reads its parameters from). ``setattr`` would go through
    ``register_parameter``, which :func:`lightning_rlhf.engines.train.loading.deferred_loading` patches (and which runs
    the global registration hooks again): the loaders replace a parameter's storage, not the parameter's registration.
    Runs on: every rank (model building and materialising).
    """
    module._parameters[name] = param


def put_buffer(module: nn.Module, name: str, buffer: torch.Tensor) -> None:
    """Put ``buffer`` in ``module``'s buffer slot ``name``, keeping whether it is persistent. Relies on:
    ``nn.Module._buffers`` (the dict the module reads its buffers from; ``register_buffer`` would need the private
    ``_non_persistent_buffers_set`` to keep the buffer's persistence). Runs on: every rank (materialising).
    """
    module._buffers[name] = buffer
