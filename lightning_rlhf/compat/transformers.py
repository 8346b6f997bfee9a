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

__all__ = ["SUPPORTED_TRANSFORMERS", "attention_implementation", "checkpoint_key_renamer", "no_split_modules"]

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


def checkpoint_key_renamer(model: nn.Module) -> Any:
    """A function from a checkpoint's tensor name to the built model's, with the renamings transformers applies while
    loading ``model``'s architecture (e.g. a Qwen2-VL checkpoint's legacy ``model.layers.*`` / ``visual.*`` for
    ``model.language_model.layers.*`` / ``model.visual.*``); None when there are none, or when any conversion merges or
    splits tensors (the sharded loader reads tensors as they are stored). Relies on: ``transformers.conversion_mapping.
    get_model_conversion_mapping`` and ``transformers.core_model_loading.rename_source_key`` /``WeightRenaming`` (5.x).
    Runs on: every process (the sharded loader)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # transformers 4.x renames nothing while loading
        return None
    transforms = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    if not renamings or len(renamings) != len(transforms):
        return None

    def rename(key: str) -> str:
        return str(rename_source_key(key, renamings, [])[0])

    return rename
