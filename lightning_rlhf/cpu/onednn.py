"""Float32 linear layers on CPU through oneDNN's matmul instead of MKL's ``sgemm``, and the decoding loop's prepacked
products (:func:`packed_linear`, float32 and bfloat16).

MKL picks its code path by CPU vendor: on an AMD CPU it skips its AVX-512 kernels. On this project's machines (AMD
EPYC, Zen 5) MKL's ``sgemm`` runs at 100-110 GFLOP/s on one thread while oneDNN (inside PyTorch,
``torch.ops.mkldnn._linear_pointwise``), which picks its kernels by instruction set, reaches 230-250 on a large square
product and 140-260 on the small model's training shapes: 2-2.4x. Both compute in float32 with float32 accumulation;
only the order of the sums differs (3-6e-6 relative against float64; docs/performance-log.md, "Float32 matmuls through
oneDNN"). :func:`onednn_linears` switches a model's ``nn.Linear`` layers to :class:`OneDNNLinearFunction` (the
training engine, when it binds a role's model); only float32 plain CPU tensors take it, anything else (bfloat16 goes
to oneDNN inside PyTorch already, other devices, DTensor) calls ``F.linear``. ``LIGHTNING_RLHF_ONEDNN=0`` keeps
PyTorch's own float32 matmuls.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_rlhf.cpu.kernels import restore_forwards, switch_forwards
from lightning_rlhf.cpu.native import cpuinfo_line

__all__ = [
    "ONEDNN_ENV",
    "OneDNNLinearFunction",
    "bf16_supported",
    "fp32_through_onednn",
    "linear",
    "linear_pointwise",
    "matmul_nt",
    "onednn_available",
    "onednn_linears",
    "packed_linear",
    "packs",
    "plain_linears",
    "reorder_linear_weight",
    "unsafe_view",
]

ONEDNN_ENV = "LIGHTNING_RLHF_ONEDNN"
"""Environment variable: ``0`` keeps PyTorch's float32 matmuls (MKL) in the layers :func:`onednn_linears` switches."""


@functools.cache
def onednn_available() -> bool:
    """Whether float32 products can go through oneDNN here: PyTorch built with it, its ``_linear_pointwise``
    operator present, and ``LIGHTNING_RLHF_ONEDNN`` not ``0``. Runs on: any process (read once)."""
    if os.environ.get(ONEDNN_ENV, "1") == "0":
        return False
    return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


@functools.cache
def fp32_through_onednn() -> bool:
    """Whether float32 products should go through oneDNN here: where it is available (:func:`onednn_available`) and
    the CPU is an AMD one, whose AVX-512 kernels MKL skips. On an Intel CPU MKL's float32 kernels are the faster:
    with oneDNN's, the vs-TRL fp32 step took 11% longer (1.655 s against 1.486 s, 2-core Xeon; docs/performance-log.md,
    "CPU speed layer, piece by piece"). bfloat16 products take oneDNN everywhere. Runs on: any process (read once)."""
    return onednn_available() and cpuinfo_line("vendor_id").partition(":")[2].strip() == "AuthenticAMD"


def linear_pointwise(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T (+ bias)`` by oneDNN, no autograd; ``weight`` plain or packed by :func:`reorder_linear_weight`.
    Relies on: PyTorch's private operator ``torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")`` (the one
    ``torch.compile``'s CPU backend emits for linear layers). Runs on: any process."""
    out: Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out


def reorder_linear_weight(weight: Tensor, rows: int) -> Tensor:
    """``weight`` copied into oneDNN's blocked layout for products of ``rows`` rows (for :func:`linear_pointwise`).
    Relies on: PyTorch's private operator ``torch.ops.mkldnn._reorder_linear_weight(weight, rows)``. Runs on: worker.
    """
    packed: Tensor = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
    return packed


def bf16_supported() -> bool:
    """Whether this CPU's oneDNN has a bfloat16 path (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or Arm's BF16); False where
    PyTorch lacks the probe. Relies on: PyTorch's private operator ``torch.ops.mkldnn._is_mkldnn_bf16_supported()``.
    Runs on: any process."""
    ops = torch.ops.mkldnn
    return bool(hasattr(ops, "_is_mkldnn_bf16_supported") and ops._is_mkldnn_bf16_supported())


def unsafe_view(out: Tensor) -> Tensor:
    """``out`` re-labelled as a tensor of its own (not a view of its base) without a copy, as ``aten::matmul`` does.
    Relies on: PyTorch's private operator ``torch.ops.aten._unsafe_view``. Runs on: any process."""
    viewed: Tensor = torch.ops.aten._unsafe_view.default(out, out.shape)
    return viewed


def matmul_nt(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """``a @ b.T (+ bias)`` through oneDNN, with no autograd: ``a`` ``[..., k]``, ``b`` ``[n, k]``, either of any
    strides (a transposed view is read as it lies). Float32 CPU tensors only. Runs on: any process.

    The result is a tensor of its own, never a view: oneDNN hands a 3-D (or higher) ``a``'s product back as a view
    of the product it made, which FSDP2 warns about when a model returns it (an lm_head's logits: "returned a view
    tensor ... will silently drop the pre-backward hook"). Like ``aten::matmul`` it is re-labelled without a copy
    (``_unsafe_view``; safe here: nothing else holds that product)."""
    out = linear_pointwise(a, b, bias)
    return out if out._base is None else unsafe_view(out)


class OneDNNLinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` with the forward and both backward products through oneDNN (:func:`matmul_nt`);
    the weight's gradient as whichever of ``grad.T @ x`` or ``(x.T @ grad).T`` has the fewer output rows (1.3-2x faster
    in oneDNN on these shapes). Saves the same tensors as ``F.linear``'s autograd (the input and the weight)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return matmul_nt(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = matmul_nt(grad, weight.t())
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            inputs = x.reshape(-1, x.shape[-1])
            out_features, in_features = weight.shape
            if out_features <= in_features:
                grad_weight = matmul_nt(rows.t(), inputs.t())
            else:  # the transposed product has fewer output rows: faster in oneDNN; one copy back to [out, in]
                grad_weight = matmul_nt(inputs.t(), rows.t()).t().contiguous()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias


def _plain(t: Tensor | None) -> bool:
    """A float32 CPU tensor of no subclass but ``nn.Parameter`` (FSDP2's unsharded parameters are those)."""
    return t is None or (type(t) in (Tensor, nn.Parameter) and t.dtype == torch.float32 and t.device.type == "cpu")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``; float32 CPU tensors go through oneDNN (:class:`OneDNNLinearFunction`, or
    :func:`matmul_nt` directly where no gradient is recorded); empty tensors, any other dtype, device or tensor
    subclass, and calls inside ``torch.backends.mkldnn.flags(enabled=False)`` take ``F.linear``. Runs on: any process
    (inside a model's forward).
    """
    usable = onednn_available() and torch.backends.mkldnn.enabled  # `mkldnn.flags(enabled=False)` is honoured
    if not (usable and _plain(x) and _plain(weight) and _plain(bias) and x.numel() and weight.numel()):
        return F.linear(x, weight, bias)  # oneDNN has no primitive for an empty product
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return OneDNNLinearFunction.apply(x, weight, bias)
    return matmul_nt(x, weight, bias)


def _onednn_forward(self: nn.Linear, x: Tensor) -> Tensor:
    """The ``forward`` a switched ``nn.Linear`` gets (bound to the instance)."""
    return linear(x, self.weight, self.bias)


def onednn_linears(model: nn.Module) -> int:
    """Switch every ``nn.Linear`` of ``model`` (the class itself: subclasses such as adapters keep their forward) to
    :func:`linear`; returns how many were switched (0 where oneDNN is not available or turned off). In place and
    idempotent, as :func:`~lightning_rlhf.cpu.kernels.switch_forwards`; :func:`plain_linears` undoes it. Runs on: every
    process that binds the model (the training engine, before FSDP sharding; the CPU layer calls it only where
    :func:`fp32_through_onednn`).
    """
    if not onednn_available():
        return 0
    return switch_forwards(model, _onednn_forward, lambda module: type(module) is nn.Linear)


def plain_linears(model: nn.Module) -> int:
    """Give the layers :func:`onednn_linears` switched ``nn.Linear``'s own ``forward`` back; returns how many. Runs
    on: any process (tests, A/B benchmarks)."""
    return restore_forwards(model, _onednn_forward)


PACK_MIN_FLOAT32 = 65_536
"""Smallest float32 weight (elements) :func:`packed_linear` packs: below it oneDNN's call costs more than its kernel
saves (``[64, 64] x [64, 128]``: 14 us through MKL, 25 us packed; ``[64, 256] x [256, 256]``: 91 against 90 us; 1
thread, hot caches). In bfloat16 the packed call is faster at every size measured (from ``[64, 64] x [64, 128]`` up)."""


def packs(weight: Tensor) -> bool:
    """Whether products with ``weight`` can go through oneDNN with a prepacked copy: float32 or bfloat16 on a CPU
    with oneDNN. The decoding loop multiplies tens of rows by each weight per step; for the 4M-parameter benchmark
    model's products (``[64, 256] x [256, 1408]`` and the like, one thread) oneDNN's blocked kernels reach ~88
    GFLOP/s in float32 against MKL's 62-66 (AMD EPYC; the CPU layer packs float32 weights only where
    :func:`fp32_through_onednn`), and 160-180 against 115-140 in bfloat16. Reordering a weight costs one pass over it
    (~7 ms for that model, once per sampling call). Runs on: worker."""
    operators = all(hasattr(torch.ops.mkldnn, name) for name in ("_reorder_linear_weight", "_linear_pointwise"))
    if not (weight.device.type == "cpu" and torch.backends.mkldnn.is_available() and operators):
        return False
    if weight.dtype == torch.bfloat16:  # oneDNN's bfloat16 path needs AVX-512 (BW/VL/DQ), AVX-NE-CONVERT or Arm's BF16
        return bf16_supported()
    return weight.dtype == torch.float32


def packed_linear(weight: Tensor, bias: Tensor | None, rows: int) -> Callable[[Tensor], Tensor] | None:
    """``x @ weight.T + bias`` through oneDNN with ``weight`` reordered into its blocked layout for ``rows`` rows per
    product, or None where :func:`packs` says no, the weight is a float32 one below :data:`PACK_MIN_FLOAT32`, or
    this oneDNN lacks the path. The packed copy lives as long as the returned callable; it is made from the
    weight's values now, so a later write to the weight needs a new one. Runs on: worker (the decoding loop)."""
    if not packs(weight) or (weight.dtype == torch.float32 and weight.numel() < PACK_MIN_FLOAT32):
        return None
    try:
        packed = reorder_linear_weight(weight, rows)
    except RuntimeError:  # a build or CPU whose oneDNN lacks this path: the plain product is as exact
        return None

    def product(x: Tensor) -> Tensor:
        return linear_pointwise(x, packed, bias)

    return product
