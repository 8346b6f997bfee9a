"""Checks ``exchange`` (FSDP2 rows -> any rank's region) under torchrun with 2 processes; the test launches it.

Each rank must end with exactly its region of the full tensor, and receive exactly the bytes that are not already local;
a region that is already local is the shard itself, not a copy. Prints ``OK <rank> <bytes received per case>`` at the
end."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_rlhf.engines.rollout.reshard import TPSlice, exchange
from lightning_rlhf.strategy.strategy import shutdown_process_groups


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)  # 7 rows: FSDP2 holds 4 + 3
    param = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
    cases = [
        [None, None],  # replicated: an all-gather
        [TPSlice(0, 0, 4), TPSlice(0, 4, 3)],  # rows exactly as FSDP2 holds them: nothing moves
        [TPSlice(1, 0, 3), TPSlice(1, 3, 3)],  # column blocks (o_proj/down_proj)
        [TPSlice(0, 1, 2), TPSlice(0, 3, 2)],  # rows straddling the shard boundary
    ]
    received = []
    for needs in cases:
        region, got = exchange(param, needs)
        mine = needs[rank]
        want = full if mine is None else full.narrow(mine.dim, mine.start, mine.length)
        assert torch.equal(region, want), (rank, needs, region, want)
        # rows that are already local are not copied: the region is the shard itself (no gather, no concatenation)
        shared = region.untyped_storage().data_ptr() == param.to_local().untyped_storage().data_ptr()
        assert shared == (needs == cases[1]), (rank, needs, "a view of the shard" if shared else "a copy")
        received.append(got)
    half = torch.float16
    region, _ = exchange(param, [TPSlice(1, 0, 3), TPSlice(1, 3, 3)], dtype=half)  # cast before sending
    assert region.dtype == half
    # one write per line: the two ranks share stdout, and print() may write its parts separately
    sys.stdout.write(" ".join(["OK", str(rank), *map(str, received)]) + "\n")
    sys.stdout.flush()
    # Tear gloo down, then leave without finalising the interpreter: gloo threads still alive at finalisation
    # abort the process now and then ("terminate called without an active exception", a known torch issue),
    # after every check above has passed and been written.
    dist.barrier()
    shutdown_process_groups()  # not a bare destroy: see its docstring (an exit-time abort)
    os._exit(0)


if __name__ == "__main__":
    main()
