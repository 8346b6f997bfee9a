"""One host's shared memory as the transport of a weight hand-off between colocated ranks.

Why: over gloo (CPU) an all-gather moves under 1 GB/s between two processes on one host, 10-20x below a memcpy, and
each full tensor is then cut out of the rank-major result with one more copy. When every rank of the group maps the
same shared memory, each rank writes its own rows straight into place in the full tensors (one copy of its shard),
one barrier says every rank has written, and the engines read the full tensors where they lie.

The buffer is a file in ``/dev/shm``, reserved in full when created (``posix_fallocate``: a container's small
``/dev/shm`` gives a clean fallback instead of a SIGBUS on first touch), mapped by every rank and unlinked as soon as
they all have it or mapping it failed. Its two halves, each as large as the largest bucket (up to twice the ranks x
64 MB), count against the host's memory until the run ends (:func:`release_host_buffers`). They are used in turn: a
rank writes bucket ``k + 1`` into the other half while a slower rank may still read bucket ``k``, and comes back to
bucket ``k``'s half only after bucket ``k + 1``'s barrier, which every rank passes once done with bucket ``k``: one
barrier per bucket is enough.
"""

from __future__ import annotations

import math
import mmap
import os
import uuid

import torch
import torch.distributed as dist

__all__ = ["HostBuffer", "host_buffer", "host_memory", "release_host_buffers"]

SHM_DIR = "/dev/shm"
_ALIGN = 64


class HostBuffer:
    """A shared-memory file mapped by every rank of ``group``, in two halves of ``half_bytes`` used in turn. Build it
    with :func:`host_buffer` (collective). Runs on: every rank of the group."""

    def __init__(self, group: dist.ProcessGroup, memory: torch.Tensor, half_bytes: int) -> None:
        self.group = group
        self.half_bytes = half_bytes
        self._memory = memory
        self._turn = 0

    def next_half(self, nbytes: int) -> torch.Tensor:
        """The next half's first ``nbytes`` bytes (uint8). Runs on: every rank, for the same bucket."""
        if nbytes > self.half_bytes:
            raise ValueError(f"HostBuffer: {nbytes} bytes asked of halves of {self.half_bytes}")
        start = self._turn * self.half_bytes
        self._turn ^= 1
        return self._memory[start : start + nbytes]

    def barrier(self) -> None:
        """Every rank has written its part of the current half. Runs on: every rank (a collective)."""
        dist.barrier(group=self.group)


_BUFFERS: dict[str, HostBuffer] = {}
"""Per process group (by name): its buffer."""
_REFUSED: dict[str, int] = {}
"""Per process group: the smallest half size its ranks could not map (another host, no room in ``/dev/shm``); a
request as large gets None without asking the ranks again."""


def host_buffer(group: dist.ProcessGroup, half_bytes: int) -> HostBuffer | None:
    """The group's shared buffer with halves of at least ``half_bytes``, or None when its ranks cannot map one
    (other hosts, no ``/dev/shm``, not enough room there) or the group has one rank. A buffer that cannot grow stays
    for the requests it fits. Runs on: every rank of ``group``, at the same point with the same ``half_bytes``
    (collective the first time and whenever the buffer must grow; the answer is the same on every rank).
    """
    if dist.get_world_size(group) < 2:
        return None
    key = group.group_name
    buffer = _BUFFERS.get(key)
    if buffer is not None and buffer.half_bytes >= half_bytes:
        return buffer
    if half_bytes >= _REFUSED.get(key, math.inf):
        return None
    half = -(-max(half_bytes, 1) // _ALIGN) * _ALIGN
    memory = _open_shared(group, 2 * half)
    if memory is None:
        _REFUSED[key] = min(half_bytes, _REFUSED.get(key, half_bytes))
        return None
    _BUFFERS[key] = HostBuffer(group, memory, half)
    return _BUFFERS[key]


def host_memory(group: dist.ProcessGroup, nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of new shared memory (uint8) that every rank of ``group`` maps, or None where the ranks cannot all
    map it (other hosts, no room in ``/dev/shm``) or the group has one rank; it lives as long as a tensor views it.
    Runs on: every rank of ``group``, at the same point with the same ``nbytes`` (always a collective).
    """
    if dist.get_world_size(group) < 2:
        return None
    memory = _open_shared(group, -(-max(nbytes, 1) // _ALIGN) * _ALIGN)
    return None if memory is None else memory[:nbytes]


def release_host_buffers() -> None:
    """Unmap every group's buffer (its memory returns once no tensor views it). Runs on: every process, at the end
    of a run (``RLHFStrategy.teardown``)."""
    _BUFFERS.clear()
    _REFUSED.clear()


def _open_shared(group: dist.ProcessGroup, nbytes: int) -> torch.Tensor | None:
    """``nbytes`` of memory every rank of ``group`` maps (uint8), or None. Group rank 0 creates and reserves the
    file, every rank maps it, all agree it worked, rank 0 unlinks it (whatever happens once it exists: a rank that
    raises leaves no file behind)."""
    first = dist.get_global_rank(group, 0)
    path: str | None = None
    if dist.get_rank() == first:
        path = _create(nbytes)
    try:
        box = [path]
        dist.broadcast_object_list(box, src=first, group=group)
        memory = _map(box[0], nbytes) if box[0] is not None else None
        ok = torch.tensor([int(memory is not None)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank has mapped it (or failed) past here
    finally:
        if path is not None:
            os.unlink(path)
    return memory if int(ok) else None


def _create(nbytes: int) -> str | None:
    """A new file of ``nbytes`` reserved bytes in ``/dev/shm`` (its path), or None where that is impossible."""
    path = os.path.join(SHM_DIR, f"lightning_rlhf-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)
    return path


def _map(path: str, nbytes: int) -> torch.Tensor | None:
    """``path`` mapped shared, as a uint8 tensor; None when this rank cannot see or map the file (another host, no
    address space or memory left)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != nbytes:
            return None
        region = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return torch.frombuffer(region, dtype=torch.uint8)
