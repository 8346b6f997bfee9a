"""Faster eager kernels for the element-wise parts of Llama-family decoders, with the modules' own results.

On CPU a bfloat16 update of a small model spends about a third of each micro-batch outside its matmuls, and the
RMS norms are the largest share of that: transformers' ``*RMSNorm.forward`` (upcast to float32, mean of squares,
``rsqrt``, cast back, times the weight) is recorded op by op by autograd, whose backward then runs one backward
per op, with their temporaries (``pow``, ``mean``, ``rsqrt``, two casts and two products). :class:`RMSNormFunction`
computes the forward with the same operations (the output is bitwise the module's) and writes the backward in
closed form, in fewer passes (one norm of ``[32, 75, 256]``, forward + backward, 1 CPU thread: 3.5 -> 2.8 ms in
bfloat16, 3.1 -> 2.3 ms in float32; docs/performance.md has the update's figures):

``n = x * r``, ``r = rsqrt(mean(x^2) + eps)``, ``y = w * cast(n)``;
``dL/dw = sum(g * cast(n))``; ``dL/dx = r * (gn - n * mean(gn * n))`` with ``gn = float(g * w)``.

Saved for the backward: the input, the per-row ``r`` and (in low precision) the cast ``n`` that autograd saves
too, so memory does not grow. Gradients equal autograd's up to float32 rounding (the sums run in another order).
:func:`fuse_rms_norms` switches a model's norms of :data:`RMS_NORM_CLASSES` to it (Gemma's ``1 + w`` norms and others
are left alone).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "RMS_NORM_CLASSES",
    "RMSNormFunction",
    "fuse_rms_norms",
    "restore_forwards",
    "rms_norm",
    "switch_forwards",
    "unfuse_rms_norms",
]

RMS_NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})
"""transformers' norm classes whose forward is ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``."""


class RMSNormFunction(torch.autograd.Function):
    """transformers' Llama-family RMS norm with a closed-form backward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        h = x.float()
        r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(eps))
        # In low precision one pass: computed in float32 and rounded once on the store, as `(h * r).to(x.dtype)`.
        n = h * r if x.dtype == torch.float32 else torch.mul(h, r, out=torch.empty_like(x))
        ctx.save_for_backward(x, weight, r, None if n.dtype == torch.float32 else n)
        return weight * n

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        x, weight, r, cast = ctx.saved_tensors
        width = x.shape[-1]
        n = x.float()
        n = n.mul_(r) if n is not x else n * r  # float32 x * r, recomputed (the input is saved, not n)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            rows = tuple(range(grad.dim() - 1))
            grad_weight = (grad * (n if cast is None else cast)).sum(rows).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            gn = (grad * weight).float()
            # mean(gn * n) per row as one [1, width] x [width, 1] product per row (no [rows, width] temporary)
            dot = torch.bmm(gn.reshape(-1, 1, width), n.reshape(-1, width, 1)).view(*n.shape[:-1], 1)
            t = torch.addcmul(gn, n, dot, value=-1.0 / width)
            grad_x = t.mul_(r) if x.dtype == torch.float32 else torch.mul(t, r, out=torch.empty_like(x))
        return grad_x, grad_weight, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * (x.float() * rsqrt(mean(x^2, -1) + eps)).to(x.dtype)`` with a closed-form backward, bitwise equal to
    transformers' Llama-family ``*RMSNorm`` forward. Runs on: worker (inside a model's forward)."""
    return RMSNormFunction.apply(x, weight, eps)


def _fused_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    """The ``forward`` a switched norm module gets (bound to the instance): the fused norm for CPU tensors, the
    class's own forward for any other device (the CPU layer never runs on a GPU's tensors)."""
    if hidden_states.device.type != "cpu":
        return type(self).forward(self, hidden_states)  # type: ignore[no-any-return]
    weight: Any = self.weight
    eps: Any = self.variance_epsilon
    return rms_norm(hidden_states, weight, float(eps))


def fuse_rms_norms(model: nn.Module) -> int:
    """Switch every norm of ``model`` whose class is in :data:`RMS_NORM_CLASSES` to :func:`rms_norm`; returns how
    many were switched (0 for other architectures). In place and idempotent (:func:`switch_forwards`);
    :func:`unfuse_rms_norms` undoes it. Runs on: every process that trains the model (the training engine, when it
    binds a role's model, before FSDP sharding, which leaves the norms' forwards alone).
    """
    return switch_forwards(model, _fused_forward, _is_llama_norm)


def _is_llama_norm(module: nn.Module) -> bool:
    """A norm of :data:`RMS_NORM_CLASSES` with the attributes its forward reads."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__ in RMS_NORM_CLASSES
        and isinstance(weight, torch.Tensor)
        and hasattr(module, "variance_epsilon")
    )


def switch_forwards(model: nn.Module, forward: Callable[..., Any], wanted: Callable[[nn.Module], bool]) -> int:
    """Give every module of ``model`` for which ``wanted(module)`` holds ``forward`` bound to it as its instance
    ``forward``; returns how many. In place and idempotent; parameters, buffers, names and the state dict do not
    change. :func:`restore_forwards` undoes it. Runs on: any process.
    """
    count = 0
    for module in model.modules():
        if wanted(module):
            module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
            count += 1
    return count


def unfuse_rms_norms(model: nn.Module) -> int:
    """Give the norms :func:`fuse_rms_norms` switched their class's own ``forward`` back; returns how many. Runs on:
    any process (tests, A/B benchmarks)."""
    return restore_forwards(model, _fused_forward)


def restore_forwards(model: nn.Module, forward: Callable[..., Any]) -> int:
    """Remove every instance ``forward`` of ``model``'s modules that is ``forward`` bound to the module (what a
    switch such as :func:`fuse_rms_norms` set), so the class's own runs again; returns how many. Runs on: any process.
    """
    count = 0
    for module in model.modules():
        bound = module.__dict__.get("forward")
        if isinstance(bound, types.MethodType) and bound.__func__ is forward:
            del module.forward
            count += 1
    return count
