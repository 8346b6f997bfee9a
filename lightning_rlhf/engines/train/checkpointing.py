"""Activation checkpointing of a trained role's transformer blocks (issue 45).

Each decoder layer keeps only its input in the forward and recomputes the rest in the backward: transformers' own
``gradient_checkpointing_enable`` with torch's non-reentrant checkpoint (the form that composes with FSDP2, as
verl uses it). The shared-prefix forward runs its attention through a function the model points to only during the
call (:mod:`~lightning_rlhf.engines.train.prefix`), and so does a sequence-parallel forward
(:mod:`~lightning_rlhf.engines.train.ulysses`); a layer recomputed in the backward must see the same, so the
checkpoint's ``context_fn`` restores both around each recompute (without it the gradients would be silently wrong).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from lightning_rlhf.engines.train import ulysses
from lightning_rlhf.engines.train.prefix import recompute_context

__all__ = ["enable_activation_checkpointing"]


def enable_activation_checkpointing(model: nn.Module, *, setting: str) -> None:
    """Checkpoint every transformer block of ``model`` (a transformers model, or a module holding one: a peft model,
    a critic's backbone). Idempotent. Runs on: every process, when the role's model is built (before sharding).

    Raises:
        ValueError: ``model`` holds no transformers model that supports gradient checkpointing.
    """
    target = _transformers_model(model)
    if target is None or not getattr(target, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{setting}: activation_checkpointing=True needs a transformers model whose blocks support gradient "
            f"checkpointing; {type(model).__name__} has none. HINT: turn it off for this role."
        )
    if getattr(target, "is_gradient_checkpointing", False):
        return
    kwargs: dict[str, Any] = {"use_reentrant": False, "context_fn": _context_fn(target.config)}
    target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _context_fn(config: Any) -> Any:
    """The checkpoint's ``context_fn``: the shared-prefix layout and attention name (:func:`recompute_context`) and
    the sequence-parallel state in force at each checkpointed call, restored around its recompute."""
    prefix = recompute_context(config)

    def context_fn() -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
        forward, recompute = prefix()
        return forward, _both(recompute, ulysses.restored(ulysses.captured()))

    return context_fn


@contextlib.contextmanager
def _both(
    first: contextlib.AbstractContextManager[None], second: contextlib.AbstractContextManager[None]
) -> Iterator[None]:
    with first, second:
        yield


def _transformers_model(model: nn.Module) -> Any:
    """The outermost transformers ``PreTrainedModel`` in ``model`` (``model`` itself, or the first one found)."""
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
