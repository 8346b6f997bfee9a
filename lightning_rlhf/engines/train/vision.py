"""Vision-language models in the training and transformers engines: which class loads them, their vision keyword
arguments for a batch, and the vision tower frozen by default (docs/vision.md)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_rlhf.data.vision import VISION_COLUMN, VisionInputs, stacked_vision

__all__ = [
    "batch_vision",
    "causal_lm_class",
    "freeze_vision_tower",
    "is_vision_language",
    "placeholder_ids",
    "vision_kwargs",
    "vision_tower",
]


def is_vision_language(config: Any) -> bool:
    """Whether a transformers config is a vision-language model's (it has a ``vision_config``). Runs on: any
    process."""
    return getattr(config, "vision_config", None) is not None


def causal_lm_class(auto_class: type, config: Any) -> type:
    """The auto class that loads ``config``'s model when a role asks for ``AutoModelForCausalLM``: transformers maps
    vision-language models (Qwen2-VL, Qwen2.5-VL, ...) to ``AutoModelForImageTextToText``. Runs on: every process."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if auto_class is AutoModelForCausalLM and is_vision_language(config):
        return AutoModelForImageTextToText  # type: ignore[no-any-return]
    return auto_class


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision encoder (with its merger) of a vision-language model, None for a text model. Runs on: any
    process."""
    inner = getattr(model, "model", None)
    tower = getattr(inner, "visual", None) or getattr(model, "visual", None)
    return tower if isinstance(tower, nn.Module) else None


def freeze_vision_tower(model: nn.Module) -> int:
    """Stop gradients to the vision tower (the default: RL trains the language model); returns the parameters frozen.
    Runs on: every process, when the actor loads."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def vision_kwargs(config: Any, input_ids: Tensor, rows: Sequence[VisionInputs | None] | None) -> dict[str, Tensor]:
    """A vision-language forward's extra arguments for ``input_ids`` (``[B, T]``, each row's prompt first, its images'
    placeholders repeated per merged patch) whose rows carry ``rows``: ``pixel_values``, ``image_grid_thw`` and
    ``mm_token_type_ids`` (1 on the prompt's image tokens; the model's 3D rotary positions follow from it). Nothing for
    a batch without images. Runs on: worker.

    A placeholder the policy *sampled* (after the prompt's) gets its plain embedding in the engines; the model would
    take it for an image. It ends the response (:func:`placeholder_ids` are stop ids), so no later token sees it, and
    ``input_ids`` comes back with it replaced by padding (the caller takes its labels from its own ids).

    Raises:
        ValueError: a row's prompt holds fewer placeholders than its images' patches make.
    """
    if not rows or all(v is None for v in rows):
        return {}
    out = stacked_vision(rows, input_ids.device)
    image_token = int(config.image_token_id)
    merge = int(config.vision_config.spatial_merge_size)
    wanted = torch.tensor([0 if v is None else sum(v.tokens_per_image(merge)) for v in rows], device=input_ids.device)
    is_image = input_ids == image_token
    seen = is_image.long().cumsum(1)
    if bool((seen[:, -1] < wanted).any()):
        raise ValueError(
            f"vision_kwargs: rows hold {seen[:, -1].tolist()} image tokens where their images make {wanted.tolist()} "
            f"(merged patches). HINT: each row's `{VISION_COLUMN}` must be the images of its own prompt "
            "(PromptDataModule(image_column=) makes both)."
        )
    prompt_images = is_image & (seen <= wanted[:, None])
    sampled = is_image & ~prompt_images
    pad = getattr(config.get_text_config(), "pad_token_id", None) or 0
    out["mm_token_type_ids"] = prompt_images.to(torch.int)
    out["input_ids"] = input_ids.masked_fill(sampled, int(pad)) if bool(sampled.any()) else input_ids
    return out


@functools.lru_cache(maxsize=8)
def placeholder_ids(model_path: str) -> tuple[int, ...]:
    """A vision-language model's image and video placeholder ids (empty for a text model): stop ids of its rollouts,
    so that a sampled placeholder ends the response (:func:`vision_kwargs`). Runs on: any process."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    if not is_vision_language(config):
        return ()
    ids = (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
    return tuple(int(i) for i in ids if i is not None)


def batch_vision(batch: Any) -> list[VisionInputs | None] | None:
    """The batch's ``vision`` column, None when it has none. Runs on: any process."""
    return batch.columns.get(VISION_COLUMN)
