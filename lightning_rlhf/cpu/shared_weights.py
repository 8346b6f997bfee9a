"""One copy per host of the colocated engines' weights, which the actor's FSDP shards themselves live in.

Why: the streaming hand-off (:func:`~lightning_rlhf.engines.rollout.reshard.weights_for`) gives every rank's engine
a private copy of the full weights: each rank writes its rows into a shared bucket, then its engine copies every full
tensor out: 1.5x the engine's bytes per rank plus a barrier per bucket (3.3x a memcpy of the engine's bytes at 9.6M
parameters). When the engines of one host read their weights from the same shared memory instead, and each rank's
FSDP shard is a view of its own rows there (:func:`place_shards`), the optimizer's step writes the engines' weights
as it updates the shards: a hand-off is one all-reduce, and the host holds the weights once (docs/hybrid-engine.md,
"The resharding hook").

The protocol (every rank of the actor's mesh, inside ``ActorRole.sync_weights``; :meth:`SharedWeights.hand_off`):
(1) each rank whose rows are known to lie in the store, or to be written there by a fixed list of copies
(:class:`_Rows`), makes those copies, then an all-reduce; (2) if any rank's rows are not known (the first hand-off,
a parameter that is not row-sharded, a checkpoint loaded into new storage), each rank writes its rows of every
parameter (:func:`write_shards`), a barrier, and each rank places the shards it can; (3) each engine binds its
parameters to the store. A rank may write its rows before the all-reduce because its update already waited for
every rank: an update's first FSDP2 all-gather is joined by every rank only once its engine is done generating.
Bound engines read the shards as they are, so a generation must never run while the same actor updates: colocated
engines are called from the step's own thread, and the generation-only pool has engines of its own.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_rlhf.compat.sharding import row_shard
from lightning_rlhf.compat.torch import fsdp_params, local_tensor, set_local_tensor, sharded_param_data
from lightning_rlhf.cpu.host_share import host_memory
from lightning_rlhf.cpu.native import CastPlan
from lightning_rlhf.cpu.switches import enabled

__all__ = ["SharedWeights", "place_shards", "shards_in_place", "write_shards"]

_ALIGN = 64
"""Byte alignment of each group of tensors in the store (a cache line)."""


def weight_layout(engine: Any) -> list[list[tuple[str, torch.Size]]]:
    """Every parameter ``(name, shape)`` of a transformers ``engine`` (its ``param_names``, dtype ``engine.dtype``),
    in groups that the store lays out end to end, each group's tensors back to back: the decoding loop's fused
    projections (a layer's query/key/value weights, their biases, its gate/up weights) are groups, so the loop finds
    them fused as they lie; every other parameter is a group of one. Runs on: worker."""
    from lightning_rlhf.cpu.decode import fused_groups

    params = dict(engine.model.named_parameters())
    groups: list[list[tuple[str, torch.Size]]] = []
    placed: set[str] = set()
    grouped = {name: group for group in fused_groups(engine.model) for name in group}
    for name in engine.param_names:
        if name in placed:
            continue
        group = grouped.get(name, (name,))
        if not all(member in params and member not in placed for member in group):
            group = (name,)
        groups.append([(member, params[member].shape) for member in group])
        placed.update(group)
    return groups


class SharedWeights:
    """The host's store of one colocated engine per rank, and its hand-off. Build it with :meth:`attempt`.

    The engines read the live shards: every in-place write to a shard (the optimizer's step, a checkpoint restored in
    place, a manual edit) must come after a collective that every rank joins once its engine is done generating (the
    trainer's updates do; an edit by hand on one rank right after a hand-off would race). Runs on: every worker rank
    of the actor's mesh.
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
        self._received = 0
        """Bytes of the full weights that the other ranks write (what :meth:`hand_off` reports as received)."""
        self._rows: _Rows | None = None
        """How this rank's rows reach the store once every parameter is row-sharded (else None): the copies to make
        (none once every shard is placed there), and the shards they read, to check they are still the same."""
        self._placeable = any(
            isinstance(p, DTensor) and local_tensor(p).dtype == views[name].dtype
            for name, p in model.named_parameters()
        )
        """Whether any shard has the store's dtype (a bfloat16 engine of float32 master weights: none, and
        :func:`place_shards` is not tried)."""

    @classmethod
    def attempt(cls, engine: Any, model: nn.Module) -> SharedWeights | None:
        """The store for ``engine`` fed from the FSDP2 ``model``, or None where the hand-off must stream: an engine
        that cannot bind shared memory, a model not row-sharded on one CPU mesh (or not the engine's), ranks that
        cannot map one store (other hosts, no room in ``/dev/shm``). Runs on: every worker rank of the model's mesh,
        at the same point (collective when the store is made: the ranks agree on the answer)."""
        if not engine.abilities.binds_shared_weights or engine.slicer is not None:
            return None
        params = dict(model.named_parameters())
        meshes = {id(p.device_mesh): p.device_mesh for p in params.values() if isinstance(p, DTensor)}
        if len(meshes) != 1 or any(p.device.type != "cpu" for p in params.values()):
            return None
        (mesh,) = meshes.values()
        if mesh.ndim != 1 or mesh.size() < 2:
            return None
        groups = weight_layout(engine)
        layout = [item for group in groups for item in group]
        if {name for name, _ in layout} != set(params) or any(params[n].shape != s for n, s in layout):
            return None  # not the model the engine was built from: streaming reports what differs
        dtype: torch.dtype = engine.dtype
        offsets, total = [], 0
        for members in groups:  # each group aligned, its tensors back to back
            total = -(-total // _ALIGN) * _ALIGN
            for _, shape in members:
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
        """Bring the store up to the actor's weights and bind the engine to it (the protocol in the module docstring).
        ``received[0]`` grows by the bytes of the full weights this rank did not write. Returns the seconds this rank
        waited at the all-reduce for the others (their previous work ended later: not the hand-off's own cost). Runs
        on: every worker rank of the mesh (one all-reduce; a barrier more when a rank's rows are not known)."""
        known = self._rows is not None and self._rows.write()
        start = time.perf_counter()
        everyone = torch.tensor([int(known)])
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=self.group)  # every rank's rows written past here
        waited = time.perf_counter() - start
        if not int(everyone):
            self.engine.weights_discarded = True  # until bound: a hand-off that stops part-way is not taken for whole
            counted = [0]
            write_shards(self.model, self.views, writes_whole=self._first, received=counted)
            self._received = counted[0]
            dist.barrier(group=self.group)
            if self._placeable:  # this rank's rows only, values unchanged: no reader can tell
                place_shards(self.model, self.views)
            self._rows = _Rows.of(self.model, self.views)
        if received is not None:
            received[0] += self._received
        self.engine.bind_weights(self.views)
        return waited


class _Rows:
    """This rank's rows of every parameter in the store: the copies that write them there (a shard placed in its
    rows needs none; a float32 shard of a bfloat16 store is cast on the way, in one native call where the kernels
    exist), and each parameter's shard as it was when they were listed. Build it with :meth:`of`. Runs on: every
    worker rank (no collective)."""

    def __init__(
        self, model: nn.Module, shards: list[tuple[nn.Parameter, int]], pairs: list[tuple[Tensor, Tensor]]
    ) -> None:
        self.model = model
        self.shards = shards
        casts = [(place, local) for place, local in pairs if place.dtype != local.dtype]
        kernel = bool(casts) and enabled("native")  # the compiled cast, where the layer's kernels are on
        self.cast = CastPlan.make([place for place, _ in casts], [local for _, local in casts]) if kernel else None
        # without the kernel (none built, piece `native` off) the casts are plain copies too (copy_ casts)
        copies = [(place, local) for place, local in pairs if self.cast is None or place.dtype == local.dtype]
        self.places = [place for place, _ in copies]
        self.locals = [local for _, local in copies]

    @classmethod
    def of(cls, model: nn.Module, views: dict[str, Tensor]) -> _Rows | None:
        """The copies for ``model``'s shards, or None where a parameter is not row-sharded (the first rank writes it
        whole: :func:`write_shards` does it every hand-off)."""
        shards: list[tuple[nn.Parameter, int]] = []
        pairs: list[tuple[Tensor, Tensor]] = []
        positions: dict[int, tuple[dist.ProcessGroup, int, int]] = {}
        for name, param in model.named_parameters():
            shard = row_shard(name, param, positions)
            if shard is None:
                return None
            shards.append((param, shard.local.data_ptr()))
            if not shard.local.numel():
                continue
            start = shard.rank * shard.chunk_rows
            place = views[name][start : start + shard.local.shape[0]]
            if place.data_ptr() != shard.local.data_ptr() or place.dtype != shard.local.dtype:
                pairs.append((place, shard.local))
        return cls(model, shards, pairs)

    def write(self) -> bool:
        """Write this rank's rows (cast to the store's dtype) where they are still the shards listed; False, writing
        nothing, where they are not (the same parameter objects, a checkpoint loaded with ``assign=True`` replaces
        them, with the same storage; ~1 us a parameter)."""
        params = list(self.model.parameters())
        if len(params) != len(self.shards) or not all(
            p is q and local_tensor(p).data_ptr() == ptr for p, (q, ptr) in zip(params, self.shards, strict=True)
        ):
            return False
        if self.cast is not None:
            self.cast()
        if self.places:
            with torch.no_grad():
                torch._foreach_copy_(self.places, self.locals)
        return True


def write_shards(
    model: nn.Module, targets: dict[str, torch.Tensor], *, writes_whole: bool, received: list[int] | None = None
) -> None:
    """Write this rank's part of every parameter of ``model`` into ``targets[name]`` (the full tensor's place, e.g.
    the store of :class:`SharedWeights`), cast to the target's dtype on the way: each rank its own rows of a
    row-sharded parameter (FSDP2's ``Shard(0)``), unless they already lie there (:func:`place_shards`); any other
    parameter is made whole (``full_tensor()``, a collective for a DTensor) and written by the rank with
    ``writes_whole=True`` only. ``received[0]`` grows by the bytes of each full tensor this rank did not write itself.
    Raises ``ValueError`` for a target whose shape is not its parameter's. Runs on: every worker rank of the model's
    mesh, in the same order; the caller orders the writes against the readers (a barrier before and after).
    """
    positions: dict[int, tuple[dist.ProcessGroup, int, int]] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            target = targets[name]
            if target.shape != param.shape:
                shapes = f"{tuple(param.shape)}, its place {tuple(target.shape)}"
                raise ValueError(f"write_shards: {name!r} has shape {shapes}")
            shard = row_shard(name, param, positions)
            if shard is not None:
                local = shard.local
                if local.numel():
                    start = shard.rank * shard.chunk_rows
                    place = target[start : start + local.shape[0]]
                    if place.data_ptr() != local.data_ptr() or place.dtype != local.dtype:
                        place.copy_(local)
                written = local.numel()
            else:
                data = param.data
                if isinstance(data, DTensor):
                    data = data.full_tensor()
                if writes_whole:
                    target.copy_(data)
                written = target.numel() if writes_whole else 0
            if received is not None:
                received[0] += (target.numel() - written) * target.element_size()


def place_shards(model: nn.Module, targets: dict[str, torch.Tensor]) -> int:
    """Make the FSDP2 shards of ``model`` live in ``targets``: each row-sharded parameter's local shard becomes a view
    of its own rows in ``targets[name]``, where those rows already hold the shard's values (written by
    :func:`write_shards`), the dtypes agree and FSDP2 keeps the shard unpadded; the optimizer's step then writes the
    weights there itself. Returns the number of parameters placed (0 where none can be: e.g. float32 master weights
    for a bfloat16 engine). FSDP2 reads a shard through its parameter's ``_local_tensor`` and its own flat view of it
    (``FSDPParam._sharded_param_data``); both are pointed at the new place (``FSDPParam.reset_sharded_param``, what
    FSDP2 itself calls when a module's parameters are replaced), and a parameter whose flat view FSDP2 did not move
    there is put back as it was. Runs on: every worker rank of the model's mesh (no collective).
    """
    units: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for unit in fsdp_params(module):
                units[id(unit.sharded_param)] = unit
    positions: dict[int, tuple[dist.ProcessGroup, int, int]] = {}
    placed = 0
    with torch.no_grad():
        for name, param in model.named_parameters():
            shard = row_shard(name, param, positions)
            fsdp_param = units.get(id(param))
            target = targets.get(name)
            if shard is None or fsdp_param is None or target is None or target.dtype != shard.local.dtype:
                continue
            local, start = shard.local, shard.rank * shard.chunk_rows
            padded = getattr(fsdp_param, "padded_sharded_param_size", None)
            if local.numel() == 0 or padded != local.shape or target.shape != param.shape:
                continue  # FSDP2 pads this shard (uneven rows): its flat buffer cannot be a view of the rows
            place = target[start : start + local.shape[0]]
            if place.data_ptr() == local.data_ptr():
                placed += 1
                continue
            if not torch.equal(place, local):
                continue  # not written yet: placing it would change the weights
            set_local_tensor(param, place)
            fsdp_param.reset_sharded_param()
            if sharded_param_data(fsdp_param).data_ptr() != place.data_ptr():  # FSDP2 kept (or copied) other memory
                set_local_tensor(param, local)
                fsdp_param.reset_sharded_param()
                continue
            placed += 1
    return placed


def shards_in_place(model: nn.Module, targets: dict[str, torch.Tensor]) -> bool:
    """Whether every parameter's shard of this rank lies in its rows of ``targets`` (:func:`place_shards`), so that a
    hand-off has nothing to write. False as soon as one does not: e.g. a checkpoint loaded with ``assign=True`` gave
    a parameter new storage. Runs on: every worker rank (no collective; ~1 us a parameter)."""
    positions: dict[int, tuple[dist.ProcessGroup, int, int]] = {}
    for name, param in model.named_parameters():
        shard = row_shard(name, param, positions)
        target = targets.get(name)
        if shard is None or target is None or target.dtype != shard.local.dtype or target.shape != param.shape:
            return False
        if shard.local.numel() and target[shard.rank * shard.chunk_rows].data_ptr() != shard.local.data_ptr():
            return False
    return True
