"""Every use of transformers' private state, in one place, for the transformers versions in
:data:`SUPPORTED_TRANSFORMERS`: the attention a built model's config points to and the model's repeated blocks, each
a small function whose docstring names what it relies on, checked against the installed transformers by
``tests/unit/test_compat_transformers.py``.

Why ``>=4.56,<6``: both names have kept their meaning since 4.x and through 5.x (the tested install is 5.19), while
a major release may rename them (5.0 moved the attention registry). To support 6: run the test, fix what fails here,
then move the bound here and in ``pyproject.toml``. Runs on: any process (a leaf module: it imports nothing of
``lightning_rlhf``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["SUPPORTED_TRANSFORMERS", "attention_implementation", "no_split_modules"]

SUPPORTED_TRANSFORMERS = ">=4.56,<6"
"""The transformers versions this module is written (and tested) against; ``pyproject.toml`` states the same range."""


@contextlib.contextmanager
def attention_implementation(config: Any, name: str) -> Iterator[None]:
    """Within the block, a built model whose config is ``config`` runs attention through the function registered as
    ``name`` (``transformers.AttentionInterface.register``); the previous one is restored on exit. Relies on:
    ``PretrainedConfig._attn_implementation``, which every attention layer reads at each call to pick the function from
    the registry (the public ``set_attn_implementation`` checks and re-dispatches: too slow for every micro-batch). Runs
    on: worker (the packed forward, per call)."""
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def no_split_modules(model: nn.Module) -> set[str]:
    """The class names of a transformers model's repeated blocks (e.g. ``{"Qwen2DecoderLayer"}``); empty for a model
    that declares none (not a transformers model). Relies on: ``PreTrainedModel._no_split_modules`` (the blocks
    ``device_map`` never splits). Runs on: every worker rank (FSDP2 wraps each block)."""
    return set(getattr(model, "_no_split_modules", None) or [])
