"""AdamW that can also write the colocated engines' bfloat16 copy of the weights while it steps.

Why: a bfloat16 rollout engine fed by float32 master weights reads its own bfloat16 rows in the host's store
(:mod:`~lightning_rlhf.cpu.shared_weights`). Made at the hand-off, that cast reads every float32 row back
from DRAM after the optimizer has left it there (0.8-0.9 ms a step on the vs-TRL small model, 2.6-3.0x a memcpy of
the engine's bytes). Made inside the optimizer's pass, each row is cast while it is in the cache: the hand-off is
then one all-reduce.

How: :class:`MirroredAdamW` is ``torch.optim.AdamW`` (the same state, checkpoints and options). The hand-off gives it
its bfloat16 destinations (:meth:`MirroredAdamW.set_mirrors`); a step whose parameters and state the native kernel
can take (:class:`lightning_rlhf.cpu.native.AdamWPlan`: float32 CPU tensors, plain AdamW options, every parameter at the
same step count) updates them with PyTorch's fused CPU arithmetic and writes the destinations in the same pass. Any
other step is PyTorch's own, and leaves the copy to the hand-off. The optimizer remembers each shard's version
counter after writing its copy: :meth:`MirroredAdamW.mirrors_current` is False once anything else wrote to a shard
(a checkpoint restored in place, an edit by hand), and the hand-off casts again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_rlhf.cpu.native import AdamWPlan
from lightning_rlhf.cpu.switches import enabled
from lightning_rlhf.torch_compat import local_tensor

__all__ = ["MirroredAdamW"]


class MirroredAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step can also write bfloat16 copies of its parameters' local shards (see the
    module docstring). Without mirrors it is ``torch.optim.AdamW``.

    Runs on: every worker rank (each its own shards; no collective).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mirrors: dict[int, Tensor] = {}
        """Local shard's ``data_ptr`` -> its bfloat16 destination."""
        self._plans: dict[int, _GroupPlan] = {}
        """Each parameter group's native step, by the group's index."""
        self._written: list[tuple[Tensor, int]] | None = None
        """The shards whose copies the last step wrote, each with its version counter right after; None: not
        written since the mirrors were set."""

    def set_mirrors(self, pairs: list[tuple[Tensor, Tensor]]) -> None:
        """Write ``dst`` (bfloat16) from ``src`` (a parameter's float32 local shard) at every step from now on.

        Runs on: every worker rank, at the first hand-off into a bfloat16 store (``SharedWeights``).
        """
        self._mirrors = {src.data_ptr(): dst for src, dst in pairs}
        self._plans.clear()
        self._written = None

    def mirrors_current(self) -> bool:
        """Whether every mirror holds its shard's current values: the last step wrote them all and nothing wrote to
        the shards since. Runs on: every worker rank (the hand-off)."""
        if not self._mirrors or self._written is None or len(self._written) != len(self._mirrors):
            return False
        return all(local._version == version for local, version in self._written)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """AdamW's step; with mirrors set, in one native pass that also writes them where it can (else PyTorch's
        step, the mirrors left to the hand-off). Runs on: every worker rank."""
        if not self._mirrors or closure is not None or not self._native_step():
            self._written = None
            return _adamw_step(self, closure)
        return None

    def _native_step(self) -> bool:
        """Step every group through its :class:`AdamWPlan`; False, changing nothing, where a group does not fit."""
        steps = []
        for index, group in enumerate(self.param_groups):
            if group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]:
                return False
            if not group.get("decoupled_weight_decay", True):  # Adam's coupled decay: not AdamW's arithmetic
                return False
            params = [p for p in group["params"] if p.grad is not None]
            states = [self.state.get(p) for p in params]
            if not params or not all(s and "exp_avg" in s for s in states):
                return False  # the first step makes the state: PyTorch's
            counters = [s["step"] for s in states]  # type: ignore[index]
            low, high = torch.aminmax(torch.stack(counters))  # one step count for the whole group
            if low != high or (torch.is_tensor(group["lr"]) and group["lr"].numel() != 1):
                return False
            plan = self._plan_for(index, params, states)  # type: ignore[arg-type]
            if plan is None:
                return False
            grads = [local_tensor(p.grad) for p in params]  # type: ignore[arg-type]
            steps.append((plan, grads, group, counters, int(high) + 1))
        written: list[tuple[Tensor, int]] = []
        for plan, grads, group, counters, count in steps:
            options = {key: group[key] for key in ("betas", "eps", "weight_decay")}
            if not plan.run(grads, lr=float(group["lr"]), step=count, **options):
                if written:  # cannot happen: the gradients of every group are the shards' own layout
                    raise RuntimeError("MirroredAdamW: a gradient changed layout between two parameter groups.")
                return False
            torch._foreach_add_(counters, 1)
            # written outside PyTorch's ops: the in-place writes autograd would have counted
            torch.autograd.graph.increment_version([*plan.params, *plan.locals])
            written += [(local, local._version) for local in plan.mirrored]
        self._written = written
        return True

    def _plan_for(self, index: int, params: list[Tensor], states: list[dict[str, Any]]) -> _GroupPlan | None:
        """The group's plan, made again where its parameters, their shards' storage or their state tensors changed
        (a checkpoint loaded with ``assign=True``, an optimizer state restored, new mirrors)."""
        plan = self._plans.get(index)
        if plan is None or not plan.serves(params, states):
            locals_ = [local_tensor(p) for p in params]
            exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            mirrors = [self._mirrors.get(t.data_ptr()) for t in locals_]
            if not enabled("native"):  # the layer's compiled kernels turned off: PyTorch's step
                return None
            run = AdamWPlan.make(
                locals_, [local_tensor(t) for t in exp_avgs], [local_tensor(t) for t in exp_avg_sqs], mirrors
            )
            if run is None:
                return None
            plan = _GroupPlan(params, locals_, exp_avgs, exp_avg_sqs, mirrors, run)
            self._plans[index] = plan
        return plan


def _adamw_step(optimizer: torch.optim.AdamW, closure: Callable[[], float] | None) -> float | None:
    """PyTorch's AdamW step without its step hooks. ``Optimizer`` wraps each class's ``step`` with the hooks'
    caller once an instance exists (``step.hooked``); :meth:`MirroredAdamW.step` is wrapped already, so calling
    ``super().step()`` would run the hooks twice whenever a plain AdamW was made in the same process."""
    step = torch.optim.AdamW.step
    if getattr(step, "hooked", False):
        step = step.__wrapped__  # type: ignore[attr-defined]
    return step(optimizer, closure)  # type: ignore[no-any-return]


class _GroupPlan:
    """One parameter group's native step: its parameters and state tensors as they were planned, and the plan."""

    def __init__(
        self,
        params: list[Tensor],
        locals_: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        mirrors: list[Tensor | None],
        run: AdamWPlan,
    ) -> None:
        self.params, self.locals, self.run = params, locals_, run
        self.exp_avgs, self.exp_avg_sqs = exp_avgs, exp_avg_sqs
        self.pointers = [t.data_ptr() for t in locals_]
        self.mirrored = [t for t, m in zip(locals_, mirrors, strict=True) if m is not None]

    def serves(self, params: list[Tensor], states: list[dict[str, Any]]) -> bool:
        """Whether these are still the planned parameters, shards and state tensors (~1 us a parameter)."""
        if len(params) != len(self.params):
            return False
        planned = zip(self.params, self.exp_avgs, self.exp_avg_sqs, self.pointers, strict=True)
        return all(
            p is q and s["exp_avg"] is m and s["exp_avg_sq"] is v and local_tensor(p).data_ptr() == ptr
            for p, s, (q, m, v, ptr) in zip(params, states, planned, strict=True)
        )
