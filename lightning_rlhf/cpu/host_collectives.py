"""FSDP2's all-gathers and reduce-scatters through one host's shared memory, for CPU ranks on one machine.

Why: over gloo on CPU these collectives move data between the processes of one host at under 1 GB/s and make the
ranks wait on each other: on the vs-TRL small model (2 ranks, 5 units) a KL step's first forwards and last backward
took ~90 ms (of ~2 s) more than the same micro-batches without collectives. Through the host buffer of
:mod:`~lightning_rlhf.cpu.host_share` (its halves used in turn, one barrier a call), an all-gather is a copy of the
rank's input into its slot, one barrier and a copy of the whole output; a reduce-scatter is a copy of the rank's
whole input into its slot, one barrier and a sum, in rank order, of the ranks' slices of this rank's shard: ~1 ms a
call there (docs/performance.md). Other hosts, a GPU, a unit over :data:`MAX_HALF_BYTES` or a reduction other than
sum or average take the process group's own collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_rlhf.cpu.host_share import host_buffer

__all__ = [
    "MAX_HALF_BYTES",
    "HostAllGather",
    "HostReduceScatter",
    "gloo_all_gather",
    "gloo_reduce_scatter",
    "use_host_collectives",
]

MAX_HALF_BYTES = 128 * 2**20
"""The largest half of the group's shared buffer a collective may use (the world size times its input's bytes);
a larger unit takes gloo's collective, so the buffer (two halves) stays within 256 MB of the host's memory."""


def gloo_all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
) -> dist.Work | None:
    """The process group's own all-gather (FSDP2's default). Runs on: every worker rank."""
    if hasattr(dist, "all_gather_single"):  # torch >= 2.13 (all_gather_into_tensor is deprecated there)
        return dist.all_gather_single(output, input, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


def gloo_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op: Any, async_op: bool
) -> dist.Work | None:
    """The process group's own reduce-scatter (FSDP2's default). Runs on: every worker rank."""
    if hasattr(dist, "reduce_scatter_single"):
        return dist.reduce_scatter_single(output=output, input=input, group=group, op=op, async_op=async_op)
    return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _posted(group: dist.ProcessGroup, t: torch.Tensor) -> torch.Tensor | None:
    """Every rank's ``t`` in the next half of the group's buffer (rank-major bytes), once all have written theirs
    (one barrier); None where the shared path cannot serve ``t`` (the caller takes gloo's collective)."""
    nbytes = t.numel() * t.element_size()
    need = group.size() * nbytes
    if t.device.type != "cpu" or need > MAX_HALF_BYTES:
        return None
    buffer = host_buffer(group, need)
    if buffer is None:
        return None
    half = buffer.next_half(need)
    rank = group.rank()
    half[rank * nbytes : (rank + 1) * nbytes].copy_(_bytes(t))
    dist.barrier(group=group)
    return half


class _Allocate:
    """FSDP2's communication interface (``set_custom_all_gather`` / ``set_custom_reduce_scatter`` take any object
    with ``allocate`` and ``__call__``; its abstract classes are private)."""

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain tensor (the collective copies through the shared buffer)."""
        return torch.empty(*size, dtype=dtype, device=device)


class HostAllGather(_Allocate):
    """FSDP2's all-gather through the host's shared memory (module docstring). Runs on: every worker rank."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        """Gather every rank's ``input_tensor`` into ``output_tensor`` (rank-major); done when it returns."""
        half = _posted(group, input_tensor)
        if half is None:
            return gloo_all_gather(output_tensor, input_tensor, group, async_op)
        _bytes(output_tensor).copy_(half)
        return None


class HostReduceScatter(_Allocate):
    """FSDP2's reduce-scatter (sum or average) through the host's shared memory (module docstring). Runs on: every
    worker rank."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> dist.Work | None:
        """Sum (or average) the ranks' ``input_tensor`` and keep this rank's slice in ``output_tensor``."""
        average = op == dist.ReduceOp.AVG
        half = _posted(group, input_tensor) if average or op == dist.ReduceOp.SUM else None
        if half is None:
            return gloo_reduce_scatter(output_tensor, input_tensor, group, op, async_op)
        world, rank = group.size(), group.rank()
        slices = half.view(input_tensor.dtype).view(world, world, -1)[:, rank]
        out = output_tensor.view(-1)
        out.copy_(slices[0])
        for other in slices[1:]:
            out.add_(other)
        if average:
            out.div_(world)
        return None


def use_host_collectives(model: nn.Module) -> int:
    """Give every FSDP unit of ``model`` the shared-memory all-gather and reduce-scatter; returns how many units.
    Runs on: every worker rank, after ``fully_shard`` (collective-free: the buffer is mapped on first use)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and hasattr(m, "set_custom_all_gather")]
    for unit in units:
        unit.set_custom_all_gather(HostAllGather())  # type: ignore[arg-type]  # the interface, duck-typed
        unit.set_custom_reduce_scatter(HostReduceScatter())  # type: ignore[arg-type]
    return len(units)
