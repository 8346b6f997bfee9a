"""Row-sharded parameters as FSDP2 lays them out (``Shard(0)`` on a 1-D mesh, ``torch.chunk`` rows).

A leaf of the package (it imports only :mod:`lightning_rlhf.compat.torch`): both the trainer's weight hand-off
(:mod:`lightning_rlhf.engines.train.fsdp`) and the CPU speed layer's shared weights
(:mod:`lightning_rlhf.cpu.shared_weights`) plan their copies with it.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from lightning_rlhf.compat.torch import local_tensor

__all__ = ["RowShard", "row_shard"]


@dataclasses.dataclass(frozen=True)
class RowShard:
    """A parameter sharded by rows the way FSDP2 does it (``Shard(0)`` on a 1-D mesh, ``torch.chunk`` rows), with
    what its hand-off needs worked out once."""

    name: str
    shape: torch.Size
    local: torch.Tensor
    group: dist.ProcessGroup
    world: int
    rank: int

    @property
    def chunk_rows(self) -> int:
        """Rows per rank (the last ranks may hold fewer, or none)."""
        return -(-self.shape[0] // self.world)

    @property
    def row_numel(self) -> int:
        """Elements per row."""
        return math.prod(self.shape[1:])

    def rows_of(self, rank: int) -> int:
        """Rows that ``rank`` holds."""
        return max(0, min(self.shape[0], (rank + 1) * self.chunk_rows) - rank * self.chunk_rows)


def row_shard(
    name: str, data: torch.Tensor, positions: dict[int, tuple[dist.ProcessGroup, int, int]]
) -> RowShard | None:
    """``data`` as a :class:`RowShard`, or None unless it is a DTensor on a 1-D mesh, ``Shard(0)``, whose local shard
    holds exactly the rows ``torch.chunk`` gives this rank, contiguously. Runs on: every rank of the mesh (``positions``
    caches each mesh's group, size and this rank's place).
    """
    if not isinstance(data, DTensor) or data.dim() == 0:
        return None
    mesh = data.device_mesh
    if mesh.ndim != 1 or tuple(data.placements) != (Shard(0),):
        return None
    if id(mesh) not in positions:
        positions[id(mesh)] = (mesh.get_group(), mesh.size(), mesh.get_local_rank())
    group, world, rank = positions[id(mesh)]
    shard = RowShard(name, data.shape, local_tensor(data), group, world, rank)
    ok = shard.local.shape[0] == shard.rows_of(rank) and shard.local.is_contiguous()
    return shard if ok else None
