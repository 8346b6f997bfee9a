"""The embedded models the demo builds, by name. Standard library only: the package's ``__init__`` registers them
in every process that imports any part of ``lightning_rlhf``, reward and tool workers included, and those must not
pay for torch, transformers or Lightning to run a plain function (about 7 s of CPU per process on these machines).
"""

from __future__ import annotations

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
:mod:`lightning_rlhf.demo.warmstart` (``build(cache_dir) -> folder``). The package's ``__init__`` registers them in
:data:`lightning_rlhf.config.models.EMBEDDED_MODELS` through :func:`build_demo_model`. Each folder's name carries
:data:`~lightning_rlhf.demo.warmstart.CACHE_VERSION`, so a copy cached by an older version is never reused: the
new one is built beside it."""


def build_demo_model(builder: str, cache_dir: str) -> str:
    """Build (or find cached) the embedded model that ``warmstart.<builder>`` makes; returns its folder. Imports
    the warm start (torch, transformers) only now.

    Runs on: any process (what :func:`lightning_rlhf.config.models.resolve_model_path` calls, through a
    ``functools.partial`` that the package's ``__init__`` registers).
    """
    from lightning_rlhf.demo import warmstart

    build = getattr(warmstart, builder)
    return str(build(cache_dir))
