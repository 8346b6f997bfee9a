"""One copy per host of the colocated engines' weights: the hand-off writes each rank's FSDP rows into it.

Why: the streaming hand-off (:func:`~lightning_rlhf.engines.rollout.reshard.weights_for`) gives every rank's engine
a private copy of the full weights: through the host's shared memory each rank writes its rows into a bucket, then
its engine copies every full tensor out: 1.5x the engine's bytes per rank plus a barrier per bucket (3.3x a memcpy
of the engine's bytes at 9.6M parameters). When the engines of one host read their weights from the same shared
memory instead, a hand-off is only each rank writing its own rows there (half a memcpy of the engine's bytes at two
ranks) between two barriers, and the host holds one copy of the engine's weights instead of one per rank.

The protocol (every rank of the actor's mesh, inside ``ActorRole.sync_weights``):

1. barrier: every engine of the host is done generating with the weights it has (the colocated engines generate
   between hand-offs, never during one);
2. each rank writes its rows of every parameter into place (cast to the engine's dtype); parameters that are not
   row-sharded are written whole by the group's first rank (:func:`~lightning_rlhf.engines.train.write_shards`);
3. barrier: every part is written;
4. each engine binds its parameters to the store (once; later hand-offs find them bound).

The store lays the parameters out in the engine's order (:meth:`HFRolloutEngine.weight_layout`: each layer's
query/key/value and gate/up weights consecutive), so the decoding loop finds its fused projections as they lie.
An engine that receives weights any other way (``load_weights``) first takes a private copy, so that it never writes
into the other engines' weights. Where the ranks cannot map one store (other hosts, no room in ``/dev/shm``), the
engine cannot bind shared memory (a GPU), or the model is not row-sharded on one mesh, the hand-off streams.

The entry barrier orders a hand-off after every generation that every rank started before it. A generation that
ran on while the hand-off writes (an engine called from a background thread that outlives its step) would read torn
weights: colocated engines are called from the step's own thread (the generation-only pool, which runs in the
background, has engines of its own that never bind the store).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_rlhf.engines.train.fsdp import write_shards
from lightning_rlhf.engines.train.host_share import host_memory

__all__ = ["SharedWeights"]

_ALIGN = 64
"""Byte alignment of each group of tensors in the store (a cache line)."""


class SharedWeights:
    """The host's store of one colocated engine per rank, and its hand-off. Build it with :meth:`attempt`.

    Runs on: every worker rank of the actor's mesh.
    """

    def __init__(
        self, engine: Any, model: nn.Module, group: dist.ProcessGroup, views: dict[str, Tensor], memory: Tensor
    ) -> None:
        self.engine = engine
        self.model = model
        self.group = group
        self.views = views
        self.memory = memory
        """The store (uint8): every rank's mapping of the same shared memory, released with this object."""
        self._first = dist.get_rank(group) == 0

    @classmethod
    def attempt(cls, engine: Any, model: nn.Module) -> SharedWeights | None:
        """The store for ``engine`` fed from the FSDP2 ``model``, or None where the hand-off must stream (see the
        module docstring). Runs on: every worker rank of the model's mesh, at the same point (collective when the
        store is made: the ranks agree on the answer)."""
        if not getattr(engine, "binds_shared_weights", False) or getattr(engine, "slicer", None) is not None:
            return None
        params = dict(model.named_parameters())
        meshes = {id(p.device_mesh): p.device_mesh for p in params.values() if isinstance(p, DTensor)}
        if len(meshes) != 1 or any(p.device.type != "cpu" for p in params.values()):
            return None
        (mesh,) = meshes.values()
        if mesh.ndim != 1 or mesh.size() < 2:
            return None
        groups = engine.weight_layout()
        layout = [item for group in groups for item in group]
        if {name for name, _ in layout} != set(params) or any(params[n].shape != s for n, s in layout):
            return None  # not the model the engine was built from: streaming reports what differs
        dtype: torch.dtype = engine.dtype
        offsets, total = [], 0
        for group in groups:  # each group aligned, its tensors back to back
            total = -(-total // _ALIGN) * _ALIGN
            for _, shape in group:
                offsets.append(total)
                total += math.prod(shape) * dtype.itemsize
        group = mesh.get_group()
        memory = host_memory(group, total)  # a collective on every rank: each store is new, owned by this object
        if memory is None:
            return None
        views = {
            name: memory[start : start + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for (name, shape), start in zip(layout, offsets, strict=True)
        }
        return cls(engine, model, group, views, memory)

    def hand_off(self, received: list[int] | None = None) -> float:
        """Write this rank's part of the actor's weights into the store and bind the engine to it (the protocol in
        the module docstring). Runs on: every worker rank of the mesh (two barriers). ``received[0]`` grows by the
        bytes of the full weights this rank did not write. Returns the seconds this rank waited at the entry
        barrier for the others to arrive (their previous work ended later: not the hand-off's own cost)."""
        start = time.perf_counter()
        dist.barrier(group=self.group)
        waited = time.perf_counter() - start
        self.engine.weights_discarded = True  # until bound: a hand-off that stops part-way is not taken for whole
        write_shards(self.model, self.views, writes_whole=self._first, received=received)
        dist.barrier(group=self.group)
        self.engine.bind_weights(self.views)
        return waited
