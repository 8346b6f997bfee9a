"""Images in prompts: decoding a dataset's image values, the processor's image tokens, and one prompt's vision inputs.

A vision-language prompt travels as its token ids with **each image's placeholder repeated once per merged patch**
(what transformers' processor makes and what the trainer's forward reads), beside a :class:`VisionInputs` in the
batch's ``vision`` column: the decoded images (vLLM runs its own processor on them, from one placeholder per image:
:func:`collapse_image_tokens`) and the processor's ``pixel_values`` / ``image_grid_thw`` (the transformers engine and
the trainer). Qwen2-VL's layout (``<|vision_start|><|image_pad|><|vision_end|>``, patches merged ``merge_size``
squared) is what the functions assume; docs/vision.md.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "VISION_COLUMN",
    "PromptImages",
    "VisionInputs",
    "check_image_prompts",
    "collapse_image_tokens",
    "count_image_items",
    "expand_image_tokens",
    "load_image",
    "stacked_vision",
    "vision_inputs",
]

VISION_COLUMN = "vision"
"""The batch column holding each row's :class:`VisionInputs` (None for a row without images)."""


@dataclasses.dataclass(frozen=True, eq=False)
class VisionInputs:
    """One prompt's images, as decoded (``images``: PIL RGB images, what vLLM and the sample tables take) and as the
    processor made them into the model's inputs: ``pixel_values`` ``[patches, channels x patch volume]`` and
    ``image_grid_thw`` ``[images, 3]`` (patches in time, height and width per image)."""

    images: tuple[Any, ...]
    pixel_values: Tensor
    image_grid_thw: Tensor

    @classmethod
    def of_images(cls, images: Sequence[Any]) -> VisionInputs:
        """The images alone (no processor inputs), for an engine that runs its own processor on them (vLLM): what
        crosses to a rollout pool's engine server, where a tensor would cross as a handle to shared memory."""
        return cls(tuple(images), torch.empty(0), torch.empty(0, 3, dtype=torch.long))

    def tokens_per_image(self, merge_size: int) -> list[int]:
        """How many placeholder tokens each image takes in the prompt: its patches over ``merge_size`` squared."""
        return [int(n) // merge_size**2 for n in self.image_grid_thw.prod(-1).tolist()]


def load_image(value: Any, *, setting: str, row: int, which: str) -> Any:
    """A dataset's image value as a PIL RGB image: a PIL image, a path, raw bytes, or ``datasets``' ``{"bytes",
    "path"}`` form of an undecoded ``Image`` column. Runs on: every process, in the data module's ``setup``.

    Raises:
        ValueError: the value is of none of those kinds, or cannot be decoded (naming ``setting`` and the row).
    """
    from PIL import Image

    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, dict) and (value.get("bytes") or value.get("path")):
            data = value.get("bytes")
            image = Image.open(io.BytesIO(data)) if data else Image.open(value["path"])
        elif isinstance(value, (bytes, bytearray)):
            image = Image.open(io.BytesIO(value))
        elif isinstance(value, (str, os.PathLike)):
            image = Image.open(os.fspath(value))
        else:
            raise TypeError(f"a {type(value).__name__}, not an image, a path, bytes or datasets' {{'bytes', 'path'}}")
        image.load()
    except (OSError, TypeError, ValueError) as err:
        raise ValueError(
            f"PromptDataModule({setting}): row {row} of the {which} data holds an image that cannot be decoded "
            f"({value!r:.80}): {err}. HINT: fix or drop the row; a column of datasets.Image() decodes for you."
        ) from err
    return image.convert("RGB")


def count_image_items(messages: Sequence[dict[str, Any]]) -> int:
    """The image items (``{"type": "image"}``) in a chat's message contents. Runs on: any process."""
    count = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            count += sum(1 for item in content if isinstance(item, dict) and item.get("type") == "image")
    return count


def vision_inputs(image_processor: Any, images: Sequence[Any]) -> VisionInputs:
    """The processor's inputs for one prompt's ``images``. Runs on: every process (the data module's collate)."""
    out = image_processor(images=list(images), return_tensors="pt")
    return VisionInputs(tuple(images), out["pixel_values"], out["image_grid_thw"].long())


def expand_image_tokens(ids: Sequence[int], image_token_id: int, counts: Sequence[int]) -> list[int]:
    """``ids`` with its k-th ``image_token_id`` repeated ``counts[k]`` times (the processor's expansion). Runs on:
    any process.

    Raises:
        ValueError: ``ids`` holds another number of image tokens than ``counts`` has images.
    """
    found = sum(1 for t in ids if t == image_token_id)
    if found != len(counts):
        raise ValueError(f"{found} image tokens in the prompt for {len(counts)} images")
    out: list[int] = []
    k = 0
    for t in ids:
        if t == image_token_id:
            out += [t] * counts[k]
            k += 1
        else:
            out.append(t)
    return out


def collapse_image_tokens(ids: Sequence[int], image_token_id: int) -> list[int]:
    """``ids`` with each run of ``image_token_id`` cut to one token: the prompt vLLM's processor expands itself.
    Runs on: a worker holding a vLLM engine."""
    out: list[int] = []
    for t in ids:
        if t != image_token_id or not out or out[-1] != image_token_id:
            out.append(t)
    return out


def stacked_vision(rows: Sequence[VisionInputs | None], device: torch.device | str) -> dict[str, Tensor]:
    """The model's vision keyword arguments for a batch whose rows carry ``rows`` (in row order; rows without images
    give nothing): ``pixel_values`` and ``image_grid_thw`` concatenated. Runs on: worker."""
    kept = [v for v in rows if v is not None]
    if not kept:
        return {}
    return {
        "pixel_values": torch.cat([v.pixel_values for v in kept]).to(device),
        "image_grid_thw": torch.cat([v.image_grid_thw for v in kept]).to(device),
    }


def check_image_prompts(module: Any, *, setting: str) -> None:
    """Refuse, before any model loads, what does not carry a prompt's images yet: multi-turn episodes (an
    environment), streamed or partial rollouts (``AsyncConfig(stream=True)`` / ``partial_rollouts``: the request
    queues hand engines token ids only) and sequence parallelism. ``setting`` names the data module's image setting in
    the message. Runs on: every process, in the data module's ``setup``."""
    problems = []
    if getattr(module, "environment", None) is not None:
        problems.append("an environment (multi-turn episodes carry text only)")
    asynchronous = getattr(getattr(module, "algorithm", None), "asynchronous", None)
    if asynchronous is not None and (asynchronous.stream or asynchronous.partial_rollouts):
        problems.append("AsyncConfig(stream=True) or partial_rollouts=True (streamed requests carry token ids only)")
    if int(getattr(module, "sequence_parallel", 1) or 1) > 1:
        problems.append(f"RLHFModule(sequence_parallel={module.sequence_parallel})")
    if problems:
        raise ValueError(
            f"PromptDataModule({setting}): prompts with images cannot run with {'; '.join(problems)} yet. HINT: drop "
            "those settings for a vision-language run (one-step-off rollouts on a pool, max_staleness=1, do carry "
            "images), docs/vision.md."
        )


@dataclasses.dataclass
class PromptImages:
    """A prompt data module's images (``PromptDataModule(image_column=...)``): each row's images decoded, the chat
    that places them, the rendered ids' placeholders expanded, and the processor's inputs made per batch. Runs on:
    every process, in the data module's ``setup`` and collate.

    Args:
        column: the dataset column holding each row's image or images.
        tokenizer: the model's tokenizer (its image placeholder token).
        image_processor: the model's image processor (``AutoImageProcessor``).
    """

    column: str
    tokenizer: Any
    image_processor: Any

    @property
    def setting(self) -> str:
        """The data module's setting, for error messages."""
        return f"image_column={self.column!r}"

    @property
    def image_token_id(self) -> int:
        """The image placeholder's id (Qwen2-VL's ``<|image_pad|>``)."""
        token = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"
        return int(self.tokenizer.convert_tokens_to_ids(token))

    def decode(self, row: dict[str, Any], *, index: int, which: str) -> list[Any]:
        """Row ``index``'s images as PIL RGB images (:func:`load_image` on each)."""
        value = row[self.column]
        values = value if isinstance(value, list) else [value]
        return [load_image(v, setting=self.setting, row=index, which=which) for v in values]

    def chat(self, text: str, images: Sequence[Any]) -> list[dict[str, Any]]:
        """A text prompt as one user turn, its images first (what TRL and verl do with a plain prompt)."""
        return [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]}]

    def check_chat(self, messages: Sequence[dict[str, Any]], images: Sequence[Any], *, index: int, which: str) -> None:
        """Refuse a chat whose image items are not the row's images in number."""
        items = count_image_items(messages)
        if items != len(images):
            raise ValueError(
                f"PromptDataModule({self.setting}): row {index} of the {which} data has {len(images)} images and "
                f"{items} image items ({{'type': 'image'}}) in its chat. HINT: give each image one image item in the "
                "messages, in order."
            )

    def expand(self, ids: list[int], images: Sequence[Any], *, index: int, which: str) -> list[int]:
        """The rendered ``ids`` with each image's placeholder repeated once per merged patch of that image."""
        merge = int(getattr(self.image_processor, "merge_size", 1))
        counts = vision_inputs(self.image_processor, images).tokens_per_image(merge)
        try:
            return expand_image_tokens(ids, self.image_token_id, counts)
        except ValueError as err:
            token = self.tokenizer.convert_ids_to_tokens(self.image_token_id)
            raise ValueError(
                f"PromptDataModule({self.setting}): row {index} of the {which} data: {err} (the rendered prompt must "
                f"hold one {token!r} per image). HINT: remove image tokens written into the prompt text; the chat "
                "template places them."
            ) from err

    def inputs(self, rows: Sequence[dict[str, Any]]) -> list[VisionInputs]:
        """Each row's :class:`VisionInputs` (made per batch: the pixel values are not kept for the whole dataset)."""
        return [vision_inputs(self.image_processor, row[self.column]) for row in rows]
