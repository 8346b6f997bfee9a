"""The embedded models the demo builds, registered by name when this module is imported: the first lookup of an
embedded name imports it (:data:`lightning_rlhf.config.models.EMBEDDED_PROVIDERS`). Standard library only, since
reward and tool workers that name an embedded model must not pay for torch, transformers or Lightning (about 7 s
of CPU per process on these machines)."""

from __future__ import annotations

import functools
import os

from lightning_rlhf.config.models import register_embedded_model

__all__ = ["DEMO_MODELS", "FAMILY_MODELS", "build_demo_model", "build_family_model"]

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
    "lightning-rlhf/tiny-vision": (
        "tiny_vision_model",
        "a tiny Qwen2-VL (the same tokenizer with vision tokens, a 2-block vision tower) and its processor, "
        "warm-started on the visual task's answer format (docs/vision.md)",
    ),
}
"""The embedded models the demo builds, by name: ``(builder, description)``, ``builder`` a function of
:mod:`lightning_rlhf.demo.warmstart` (``build(cache_dir) -> folder``), registered below through
:func:`build_demo_model`. Each folder's name carries :data:`~lightning_rlhf.demo.warmstart.CACHE_VERSION`, so a
copy cached by an older version is never reused: the new one is built beside it."""


FAMILY_MODELS: dict[str, str] = {
    f"lightning-rlhf/random-{family}": family
    for family in ("qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b", "gemma-3-1b", "mistral-7b-v0.3", "smollm2-360m")
}
"""Real families at their published size with random weights, by name: the family of
:data:`lightning_rlhf.demo.families.FAMILIES` (its published configuration at full depth, a local tokenizer with
its special tokens and chat template): for measuring memory and time at a real size (recipes/real_size_cpu.yaml),
not for learning."""


def build_demo_model(builder: str, cache_dir: str) -> str:
    """Build (or find cached) the embedded model that ``warmstart.<builder>`` makes; returns its folder. Imports the
    warm start (torch, transformers) only now. Runs on: any process (what ``resolve_model_path`` calls)."""
    from lightning_rlhf.demo import warmstart

    build = getattr(warmstart, builder)
    return str(build(cache_dir))


def build_family_model(family: str, cache_dir: str) -> str:
    """Build (or find cached) ``lightning-rlhf/random-<family>`` at its published depth (seed 0); concurrent callers
    share one copy. Runs on: any process (what ``resolve_model_path`` calls)."""
    from lightning_rlhf.demo import warmstart
    from lightning_rlhf.demo.families import FAMILIES, build_family

    depth = FAMILIES[family].layers
    return warmstart.build_once(
        cache_dir,
        f"random-{family}-{warmstart.CACHE_VERSION}-seed0",
        lambda tmp: build_family(family, os.path.join(tmp, "model"), layers=depth),
    )


for _name, (_builder, _description) in DEMO_MODELS.items():
    register_embedded_model(_name, functools.partial(build_demo_model, _builder), _description)
for _name, _family in FAMILY_MODELS.items():
    register_embedded_model(
        _name,
        functools.partial(build_family_model, _family),
        f"{_family}'s published configuration with random weights and a local tokenizer (memory and time at a real "
        "size, not learning)",
    )
del _name, _builder, _description, _family
