"""The embedded models the demo builds, registered by name when this module is imported: the first lookup of an
embedded name imports it (:data:`lightning_rlhf.config.models.EMBEDDED_PROVIDERS`). Standard library only, since
reward and tool workers that name an embedded model must not pay for torch, transformers or Lightning (about 7 s
of CPU per process on these machines)."""

from __future__ import annotations

import functools

from lightning_rlhf.config.models import register_embedded_model

__all__ = ["DEMO_MODELS", "build_demo_model"]

DEMO_MODELS: dict[str, tuple[str, str]] = {
    "lightning-rlhf/tiny-addition": (
        "tiny_addition_model",
        "the demo's tiny Qwen2 model (byte-level BPE tokenizer), warm-started on single-digit addition",
    ),
    "lightning-rlhf/tiny-random": (
        "tiny_random_model",
        "the same tiny Qwen2 model and tokenizer, randomly initialised (warm-start it on your own task first)",
    ),
    "lightning-rlhf/tiny-tools": (
        "tiny_tools_model",
        "the same tiny model with a tool chat template, warm-started to call a calculator for 3-digit additions",
    ),
}
"""The embedded models the demo builds, by name: ``(builder, description)``, ``builder`` a function of
:mod:`lightning_rlhf.demo.warmstart` (``build(cache_dir) -> folder``), registered below through
:func:`build_demo_model`. Each folder's name carries :data:`~lightning_rlhf.demo.warmstart.CACHE_VERSION`, so a
copy cached by an older version is never reused: the new one is built beside it."""


def build_demo_model(builder: str, cache_dir: str) -> str:
    """Build (or find cached) the embedded model that ``warmstart.<builder>`` makes; returns its folder. Imports the
    warm start (torch, transformers) only now. Runs on: any process (what ``resolve_model_path`` calls)."""
    from lightning_rlhf.demo import warmstart

    build = getattr(warmstart, builder)
    return str(build(cache_dir))


for _name, (_builder, _description) in DEMO_MODELS.items():
    register_embedded_model(_name, functools.partial(build_demo_model, _builder), _description)
del _name, _builder, _description
