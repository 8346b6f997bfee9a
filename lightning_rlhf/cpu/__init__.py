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

The interface: the rest of the package imports only ``lightning_rlhf.cpu`` (``tests/unit/test_layers.py`` checks
it), never a module inside it, and calls the functions below; each returns None (or does nothing) where its piece is
off or cannot serve the tensors given, and the caller goes on with PyTorch's own ops.
(The switch itself is :mod:`lightning_rlhf.cpu.switches`, a leaf that the pieces import.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from lightning_rlhf.cpu import native
from lightning_rlhf.cpu.host_share import HostBuffer
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

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = [
    "ENV",
    "OFF_ENV",
    "PIECES",
    "HostBuffer",
    "WeightStore",
    "collectives",
    "configure",
    "decode_attention",
    "decode_step",
    "enabled",
    "host_buffer",
    "host_memory_release",
    "kernels_available",
    "matmul_product",
    "norm",
    "packed_linear",
    "packs",
    "pieces_off",
    "restore_model",
    "setting",
    "silu_mul",
    "speed_up_model",
    "token_logprobs",
    "token_logprobs_backward",
    "weight_store",
]


def kernels_available() -> bool:
    """Whether the compiled kernels are on and built here (compiles them on the first call). Runs on: any process."""
    return enabled("native") and native.native_attention_available()


# ------------------------------------------------------------------------------------------- training models
def speed_up_model(model: nn.Module, *, norms: bool = True, linears: bool = True) -> int:
    """Switch ``model``'s Llama-family RMS norms to the fused kernel (``norms``, piece ``rms_norm``) and its
    ``nn.Linear`` layers to oneDNN's float32 products (``linears``, piece ``onednn``), where those pieces are on;
    returns how many modules were switched. In place and idempotent; parameters, names and the state dict do not
    change; tensors other than CPU ones take the modules' own forwards at call time.

    Runs on: every process that binds a role's model (the training engine, before FSDP sharding).
    """
    from lightning_rlhf.cpu import kernels, onednn

    count = 0
    if norms and enabled("rms_norm"):
        count += kernels.fuse_rms_norms(model)
    if linears and enabled("onednn") and onednn.fp32_through_onednn():  # on Intel CPUs MKL's float32 is faster
        count += onednn.onednn_linears(model)
    return count


def restore_model(model: nn.Module) -> int:
    """Give every module :func:`speed_up_model` switched its class's own ``forward`` back; returns how many. Runs
    on: any process (tests, A/B benchmarks)."""
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


# ------------------------------------------------------------------------------------------- FSDP and hand-offs
def collectives(model: nn.Module) -> int:
    """Give every FSDP2 unit of ``model`` the host's shared-memory all-gather and reduce-scatter (piece
    ``collectives``); returns how many units (0 where off). Each call still takes the process group's collective
    where the shared path cannot serve it. Runs on: every worker rank, after ``fully_shard`` on a CPU mesh."""
    if not enabled("collectives"):
        return 0
    from lightning_rlhf.cpu.host_collectives import use_host_collectives

    return use_host_collectives(model)


def host_buffer(group: dist.ProcessGroup, half_bytes: int) -> HostBuffer | None:
    """The group's shared-memory buffer for a hand-off's buckets (piece ``hand_off``), or None: off, other hosts, no
    room in ``/dev/shm``, one rank. Runs on: every rank of ``group``, at the same point with the same size
    (collective the first time and whenever the buffer grows)."""
    if not enabled("hand_off"):
        return None
    from lightning_rlhf.cpu.host_share import host_buffer as buffer

    return buffer(group, half_bytes)


def host_memory_release() -> None:
    """Unmap every shared buffer this process holds. Runs on: every process, at the end of a run."""
    from lightning_rlhf.cpu.host_share import release_host_buffers

    release_host_buffers()


class WeightStore(Protocol):
    """What the actor holds of :func:`weight_store`'s answer."""

    def hand_off(self, received: list[int] | None = None) -> float:
        """Bring the store up to the actor's weights and bind the engine to it; the seconds waited."""
        ...


def weight_store(engine: Any, model: nn.Module) -> WeightStore | None:
    """One copy per host of the colocated engines' weights, fed from the FSDP2 ``model`` (piece ``shared_weights``),
    or None where the hand-off must stream (off, an engine that cannot bind shared memory, other hosts, ...). Runs
    on: every worker rank of the model's mesh, at the same point (collective when the store is made)."""
    if not enabled("shared_weights"):
        return None
    from lightning_rlhf.cpu.shared_weights import SharedWeights

    return SharedWeights.attempt(engine, model)


# ------------------------------------------------------------------------------------------- decoding loop
def decode_step(
    prefix_keys: Tensor,
    prefix_values: Tensor,
    prefix_bias: Tensor,
    keys: Tensor,
    values: Tensor,
    *,
    n: int,
    group: int,
    scaling: float,
) -> Callable[[Tensor, Tensor, Tensor, int], Tensor] | None:
    """A layer's decoding step as one compiled call (rotary embedding, cache writes, attention), or None where the
    kernels are off or cannot take these tensors. Runs on: worker (the decoding loop)."""
    if not enabled("native"):
        return None
    step = native.DecodeStep.make(
        prefix_keys, prefix_values, prefix_bias, keys, values, n=n, group=group, scaling=scaling
    )
    return step


def decode_attention(
    query: Tensor,
    prefix_keys: Tensor,
    prefix_values: Tensor,
    prefix_bias: Tensor,
    keys: Tensor,
    values: Tensor,
    *,
    n: int,
    span: int,
    scaling: float,
) -> Tensor | None:
    """A decoding step's attention through the compiled kernel, or None (off, or tensors it does not take). Runs on:
    worker (the decoding loop)."""
    if not enabled("native"):
        return None
    return native.decode_attention(
        query, prefix_keys, prefix_values, prefix_bias, keys, values, n=n, span=span, scaling=scaling
    )


def norm(module: nn.Module, x: Tensor) -> Tensor | None:
    """``module(x)`` through the compiled RMS norm where ``module`` is one of transformers' Llama-family norms
    (the same formula), else None. Runs on: worker (the decoding loop)."""
    from lightning_rlhf.cpu.kernels import RMS_NORM_CLASSES

    if not enabled("native") or type(module).__name__ not in RMS_NORM_CLASSES:
        return None
    weight: Any = module.weight
    eps: Any = module.variance_epsilon
    return native.rms_norm(x, weight, float(eps))


def silu_mul(gate_up: Tensor) -> Tensor | None:
    """``silu(gate) * up`` of ``gate_up``'s two halves through the compiled kernel, or None. Runs on: worker."""
    if not enabled("native"):
        return None
    return native.silu_mul(gate_up)


def packs(weight: Tensor) -> bool:
    """Whether products with ``weight`` can go through :func:`packed_linear` (piece ``onednn`` on; bfloat16 on a CPU
    whose oneDNN has the path, float32 where oneDNN beats MKL: ``onednn.fp32_through_onednn``). Runs on: worker (the
    decoding loop)."""
    if not enabled("onednn"):
        return False
    from lightning_rlhf.cpu.onednn import fp32_through_onednn
    from lightning_rlhf.cpu.onednn import packs as can_pack

    return can_pack(weight) and (weight.dtype != torch.float32 or fp32_through_onednn())


def packed_linear(weight: Tensor, bias: Tensor | None, rows: int) -> Callable[[Tensor], Tensor] | None:
    """``x @ weight.T + bias`` through oneDNN with ``weight`` reordered into its blocked layout for ``rows`` rows a
    product (piece ``onednn``; the copy lives as long as the callable), or None where that does not pay or run.
    Runs on: worker (the decoding loop, once per sampling call)."""
    if not packs(weight):
        return None
    from lightning_rlhf.cpu.onednn import packed_linear as packed

    return packed(weight, bias, rows)


# ------------------------------------------------------------------------------------------- token log-probs
def token_logprobs(
    logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None] | None:
    """``(logp, lse, entropy, mean)`` through the compiled kernel, or None (off, or logits it does not take). Runs
    on: controller or worker (the training forward)."""
    if not enabled("native"):
        return None
    return native.token_logprobs(logits, labels, temperature, with_entropy)


def token_logprobs_backward(
    logits: Tensor,
    labels: Tensor,
    lse: Tensor,
    mean: Tensor | None,
    grad_logp: Tensor,
    grad_entropy: Tensor | None,
    temperature: float,
) -> Tensor | None:
    """The logits' gradient of :func:`token_logprobs` through the compiled kernel, or None. Runs on: controller or
    worker (the training backward)."""
    if not enabled("native"):
        return None
    return native.token_logprobs_backward(logits, labels, lse, mean, grad_logp, grad_entropy, temperature)
