"""Sequence parallelism (DeepSpeed-Ulysses, as verl does it) for the forwards of the trained and scoring roles.

The ``N`` ranks of a sequence-parallel group get the same rows; each runs the model on its contiguous ``1/N`` of the
columns (input ids and positions computed on the whole sequence first, then sliced). Every attention layer goes
through :data:`ATTENTION_NAME`: an all-to-all turns ``q``/``k``/``v`` of the local columns and all heads into the
whole sequence and ``H/N`` heads, the model's own attention runs on it, and a second all-to-all brings the output
back. The forwards left-align every row first (``forward.left_aligned``: real tokens from column 0, padding after),
so ``sdpa`` runs its causal kernels with no mask; a ``[T, T]`` mask of the whole sequence (:func:`full_mask`) is built
only for ``eager`` attention or a row with padding between real tokens. The per-token outputs (log-probs,
values) are gathered along the sequence, so every rank of the group computes the same loss; the gather's backward
keeps this rank's columns of the gradient, times ``N``, since FSDP averages the gradients over all ``N * D`` ranks of
the pool while the group's ``N`` ranks each hold one part of one sample's gradient.

The attention is registered with transformers' ``AttentionInterface`` and the model points to it only during a
sharded call (:func:`sharded`), like the shared-prefix forward; a recompute under activation checkpointing runs
with the state captured at its forward (:func:`captured` / :func:`restored`).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from lightning_rlhf.compat.transformers import attention_implementation

__all__ = [
    "ATTENTION_NAME",
    "SequenceShard",
    "captured",
    "check_model",
    "check_size",
    "give_sequence_groups",
    "restored",
    "sharded",
]

ATTENTION_NAME = "lightning_rlhf_ulysses"
INNER_ATTENTIONS = ("sdpa", "eager")
"""The attention kernels the wrapper calls on the whole sequence: sdpa with no mask (its causal kernels) when every
row is real tokens then padding (:func:`causal_suffices`), else with a mask of it."""


def check_size(value: Any, *, setting: str) -> int:
    """``value`` as a sequence-parallel size (an integer >= 1). Runs on: any process, when settings are made."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{setting}={value!r} is invalid: expected an integer >= 1 (the ranks that share each sequence). "
            "HINT: 1 turns sequence parallelism off; 2, 4, ... split every sequence over that many ranks."
        )
    return value


def check_model(model: nn.Module, size: int, *, setting: str) -> None:
    """Refuse (ValueError) a model whose attention the wrapper cannot run split ``size`` ways: not a transformers
    model on the attention interface, query heads not divisible by ``size``, or a kernel other than sdpa/eager.
    Runs on: every process, when the role's model is bound (before sharding)."""
    from transformers import PreTrainedModel

    target = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    config: Any = getattr(target, "config", None)
    if target is None or config is None or not getattr(target, "_supports_attention_backend", False):
        raise ValueError(
            f"{setting}: sequence_parallel={size} needs a transformers model whose attention goes through "
            f"transformers' attention interface; {type(model).__name__} has none. HINT: sequence_parallel=1."
        )
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads % size:
        raise ValueError(
            f"{setting}: sequence_parallel={size} must divide the model's num_attention_heads={heads} (each rank "
            f"attends with heads/{size} of them over the whole sequence). HINT: use a divisor of {heads}."
        )
    kernel = config._attn_implementation
    if kernel not in INNER_ATTENTIONS:
        raise ValueError(
            f"{setting}: sequence_parallel={size} runs the model's attention through a wrapper that needs "
            f"attn_implementation in {INNER_ATTENTIONS}; the model uses {kernel!r}. HINT: "
            "RLHFModule(attn_implementation='sdpa')."
        )


@dataclass
class SequenceShard:
    """One rank's columns of a batch's sequences of ``length`` columns in a group of ``size`` ranks: the length is
    padded to a multiple of ``size`` (``padded``) and rank ``rank`` holds ``[start, stop)``. Runs on: worker."""

    length: int
    size: int
    rank: int
    group: Any = None

    @property
    def padded(self) -> int:
        """The sequence length padded to a multiple of ``size``."""
        return -(-self.length // self.size) * self.size

    @property
    def width(self) -> int:
        """Columns per rank."""
        return self.padded // self.size

    @property
    def start(self) -> int:
        """This rank's first column."""
        return self.rank * self.width

    @property
    def stop(self) -> int:
        """One past this rank's last column."""
        return self.start + self.width

    def pad(self, t: Tensor) -> Tensor:
        """``t`` (``[B, length, ...]``) right-padded with 0 to ``padded`` columns."""
        missing = self.padded - t.shape[1]
        return F.pad(t, [0, 0] * (t.dim() - 2) + [0, missing]) if missing else t

    def local(self, t: Tensor) -> Tensor:
        """This rank's columns of ``t`` (``[B, length, ...]``), padded first."""
        return self.pad(t)[:, self.start : self.stop]

    def kept(self, first: int, stop: int) -> tuple[int, int]:
        """The global columns of ``[first, stop)`` that this rank holds, as ``(lo, hi)`` (``lo == hi``: none)."""
        lo, hi = max(first, self.start), min(stop, self.stop)
        return lo, max(lo, hi)

    def gather(self, local: Tensor, lo: int, hi: int) -> Tensor:
        """The group's outputs ``[B, padded]`` (0 where no rank computed one) from each rank's ``local`` outputs at
        its :meth:`kept` columns ``[lo, hi)`` (``[B, hi - lo]``); every rank returns the same, whose backward keeps
        this rank's columns. Runs on: every rank of the group together (an all-gather)."""
        placed = (
            F.pad(local, [lo - self.start, self.stop - hi])
            if hi > lo
            else local.sum() * 0 + local.new_zeros(local.shape[0], self.width)
        )
        return _Gather.apply(placed, self.group, self.size, self.rank)


class _Gather(torch.autograd.Function):
    """All-gather along dim 1; the backward keeps this rank's columns of the gradient times the group size."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, size: int, rank: int) -> Tensor:
        ctx.size, ctx.rank, ctx.width = size, rank, x.shape[1]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return grad[:, ctx.rank * ctx.width : (ctx.rank + 1) * ctx.width] * ctx.size, None, None, None


class _State(threading.local):
    value: dict[Any, Any] | None = None


_STATE = _State()


def _exchange(x: Tensor, group: Any) -> Tensor:
    """All-to-all of dim 0 (equal parts, one per rank of ``group``: part ``i`` goes to rank ``i``), with autograd."""
    return _AllToAll.apply(x, group)


class _AllToAll(torch.autograd.Function):
    """All-to-all of equal parts of dim 0; its backward is the same exchange of the gradient (it is its own
    inverse)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        x = x.contiguous()  # first: empty_like keeps a transposed view's strides, which the collective ignores
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[Tensor, None]:
    """Ulysses attention: ``query`` ``[B, H, L, d]`` and ``key``/``value`` ``[B, Hkv, L, d]`` of this rank's ``L``
    columns; returns ``[B, L, H, d]``."""
    state = _STATE.value
    if state is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention runs only inside a sequence-parallel forward (sharded()).")
    group, n = state["group"], state["size"]
    b, heads, width, d = query.shape
    kv = key.shape[1]
    if kv % n:  # key/value heads repeated (each one next to its copies) to a multiple of the group, as verl does
        repeat = n // math.gcd(kv, n)
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        kv *= repeat

    def split(t: Tensor) -> Tensor:  # [B, h, L, d] -> [n, B, h/n, L, d]: head part i goes to rank i
        return t.reshape(b, n, t.shape[1] // n, width, t.shape[-1]).transpose(0, 1)

    # One all-to-all for q, k and v together: [n, B, (H + 2 Hkv)/n, L, d] -> each rank's head part, all columns.
    mixed = _exchange(torch.cat([split(query), split(key), split(value)], dim=2), group)
    mixed = mixed.permute(1, 2, 0, 3, 4).reshape(b, (heads + 2 * kv) // n, n * width, d)
    q, k, v = mixed.split([heads // n, kv // n, kv // n], dim=1)
    previous = getattr(module, "num_key_value_groups", None)
    if previous is not None:  # the kernels repeat key/value heads by this ratio; it changes if they were repeated
        setattr(module, "num_key_value_groups", heads // kv)  # noqa: B010 (a plain int attribute of the layer)
    try:
        out, _ = state["inner"](module, q, k, v, _mask(state, q.dtype), **kwargs)  # [B, n L, H/n, d]
    finally:
        if previous is not None:
            setattr(module, "num_key_value_groups", previous)  # noqa: B010
    # Back: column part i to rank i, each rank then holds all heads of its own columns.
    back = _exchange(out.reshape(b, n, width, heads // n, d).transpose(0, 1), group)
    return back.permute(1, 2, 0, 3, 4).reshape(b, width, heads, d), None


AttentionInterface.register(ATTENTION_NAME, _attention)
AttentionMaskInterface.register(ATTENTION_NAME, lambda *args, **kwargs: None)  # the attention makes its own mask


def _inner_attention(module_type: type, name: str) -> Any:
    """The attention function ``name`` of the model whose attention layers are of ``module_type``: a registered one
    (sdpa), or the modeling file's own ``eager_attention_forward``."""
    if name == "eager":
        found = getattr(sys.modules[module_type.__module__], "eager_attention_forward", None)
        if found is None:
            raise ValueError(
                f"{module_type.__name__} has no eager attention to wrap. HINT: attn_implementation='sdpa'."
            )
        return found
    return AttentionInterface()[name]


def full_mask(attention_mask: Tensor) -> Tensor:
    """The boolean ``[B, 1, T, T]`` mask (True: attend) of the whole (padded) sequence: causal, padding keys masked;
    a position that would see no key (left padding) attends to itself, so no row is all masked (that would give NaN
    in the backward). Runs on: worker."""
    t = attention_mask.shape[1]
    device = attention_mask.device
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    allowed = causal[None] & attention_mask.bool()[:, None, :]
    empty = ~allowed.any(dim=-1, keepdim=True)  # a left-padding position: it attends to itself only
    return (allowed | (empty & torch.eye(t, dtype=torch.bool, device=device))).unsqueeze(1)


def causal_suffices(attention_mask: Tensor) -> bool:
    """Whether every row of ``attention_mask`` is ones then zeros (no left padding; all zeros: a row of padding only):
    then the causal mask alone gives every real position the keys it should see (a padding position attends to what
    precedes it, and its output is never used), and sdpa runs its causal kernels without a ``[T, T]`` mask. Runs on:
    worker."""
    return torch.equal(attention_mask.cummin(dim=1).values, attention_mask)


def _mask(state: dict[Any, Any], dtype: torch.dtype) -> Tensor | None:
    """The whole sequence's mask as the inner kernel takes it: for sdpa boolean, or None when causal suffices; for
    eager additive in ``dtype`` (made once per forward)."""
    if state["inner_name"] == "sdpa":
        if state["causal"]:
            return None
        if "allowed" not in state:
            state["allowed"] = full_mask(state["attention_mask"])
        return state["allowed"]
    key = ("additive", dtype)
    if key not in state:
        allowed = full_mask(state["attention_mask"])
        state[key] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min
        )
    return state[key]


@contextlib.contextmanager
def sharded(model: nn.Module, shard: SequenceShard, attention_mask: Tensor) -> Iterator[None]:
    """Within the block, ``model`` (a transformers model, or one holding it) runs attention split over ``shard``'s
    group; ``attention_mask`` ``[B, padded]`` is the whole sequences'. Runs on: every rank of the group together."""
    from transformers import PreTrainedModel

    target = next(m for m in model.modules() if isinstance(m, PreTrainedModel))
    config = target.config
    inner_name = config._attn_implementation
    if inner_name == ATTENTION_NAME:  # nested (a scoring call inside a sharded one): already set up
        yield
        return
    layer_type = next((type(m) for m in target.modules() if hasattr(m, "num_key_value_groups")), type(target))
    state: dict[Any, Any] = {
        "group": shard.group,
        "size": shard.size,
        "inner": _inner_attention(layer_type, inner_name),
        "inner_name": inner_name,
        "attention_mask": attention_mask,
        "causal": inner_name == "sdpa" and causal_suffices(attention_mask),
    }
    previous = _STATE.value
    _STATE.value = state
    try:
        with attention_implementation(config, ATTENTION_NAME):
            yield
    finally:
        _STATE.value = previous


def captured() -> dict[str, Any] | None:
    """The sequence-parallel state in force (for a checkpointed layer's recompute). Runs on: worker."""
    return _STATE.value


@contextlib.contextmanager
def restored(state: dict[str, Any] | None) -> Iterator[None]:
    """Run the block with ``state`` (from :func:`captured`) in force. Runs on: worker (a recompute)."""
    previous = _STATE.value
    _STATE.value = state
    try:
        yield
    finally:
        _STATE.value = previous


def give_sequence_groups(roles: Mapping[str, Any], pools: Mapping[str, Any], *, world_size: int, rank: int) -> None:
    """Give each role's engine with ``sequence_parallel > 1`` this rank's group of it: consecutive ranks of the role's
    pool (all ranks when it has none), ``sequence_parallel`` per group; check its model first (:func:`check_model`).
    Runs on: every rank, at set-up, together, before sharding (a new group is collective: every rank makes every
    group, in the same order; one per distinct set of ranks)."""
    made: dict[tuple[int, ...], Any] = {}
    for name in sorted(roles):
        engine = roles[name].train_engine
        n = engine.sequence_parallel
        if n == 1:
            continue
        if engine.model is not None:
            check_model(engine.model, n, setting=engine.setting)
        pool = tuple(pools.get(name, range(world_size)))
        for first in range(0, len(pool), n):
            ranks = pool[first : first + n]
            if ranks not in made:
                made[ranks] = dist.new_group(list(ranks))
            if rank in ranks:
                engine.sequence_group = made[ranks]
