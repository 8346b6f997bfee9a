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
import functools
import io
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "VISION_COLUMN",
    "ChatImages",
    "PromptImages",
    "VisionInputs",
    "check_image_prompts",
    "collapse_image_tokens",
    "count_image_items",
    "expand_image_tokens",
    "expand_placeholders",
    "image_token",
    "join_vision",
    "load_image",
    "patch_counts",
    "stacked_vision",
    "tool_images",
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


def load_image(value: Any, *, where: str) -> Any:
    """An image value as a PIL RGB image: a PIL image, a path, raw bytes, or ``datasets``' ``{"bytes", "path"}`` form
    of an undecoded ``Image`` column. ``where`` starts the error message (the setting and the row). Runs on: every
    process (the data module's ``setup``, an episode's observations).

    Raises:
        ValueError: the value is of none of those kinds, or cannot be decoded.
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
            f"{where} holds an image that cannot be decoded ({value!r:.80}): {err}. HINT: give a PIL image, a path to "
            "an image file or its bytes (a column of datasets.Image() decodes for you)."
        ) from err
    return image.convert("RGB")


def tool_images(value: Any) -> tuple[tuple[Any, ...], Any]:
    """``(the images, the rest)`` of an in-process tool's return value: a PIL image is an image with no text; a list
    or tuple holding images gives them and its other items (its strings joined by newlines when it holds only strings,
    else the list of them; None when nothing is left). Anything else: no images, the value as it is. Runs on: the
    rollout's process (a tool's thread)."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return (value,), None
    if not isinstance(value, (list, tuple)) or not any(isinstance(v, Image.Image) for v in value):
        return (), value
    images = tuple(v for v in value if isinstance(v, Image.Image))
    rest = [v for v in value if not isinstance(v, Image.Image)]
    if not rest:
        return images, None
    return images, "\n".join(rest) if all(isinstance(v, str) for v in rest) else rest


def count_image_items(messages: Sequence[dict[str, Any]]) -> int:
    """The image items (``{"type": "image"}``) in a chat's message contents. Runs on: any process."""
    count = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            count += sum(1 for item in content if isinstance(item, dict) and item.get("type") == "image")
    return count


def join_vision(first: VisionInputs | None, then: VisionInputs) -> VisionInputs:
    """``first``'s images followed by ``then``'s (an episode's prompt images, then an observation's), in order. Runs on:
    the rollout's process."""
    if first is None:
        return then
    return VisionInputs(
        first.images + then.images,
        torch.cat([first.pixel_values, then.pixel_values]),
        torch.cat([first.image_grid_thw, then.image_grid_thw]),
    )


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


def image_token(tokenizer: Any) -> str:
    """The tokenizer's image placeholder token (Qwen2-VL's ``<|image_pad|>`` when it names none). Runs on: any
    process."""
    return getattr(tokenizer, "image_token", None) or "<|image_pad|>"


def patch_counts(image_processor: Any, images: Sequence[Any]) -> list[int]:
    """Each image's placeholder count (merged patches), from its size where the processor can tell
    (``get_number_of_image_patches``: no resizing or normalising), else from its inputs. Runs on: any process."""
    merge = int(getattr(image_processor, "merge_size", 1))
    if not hasattr(image_processor, "get_number_of_image_patches"):
        return vision_inputs(image_processor, images).tokens_per_image(merge)
    return [image_processor.get_number_of_image_patches(i.height, i.width, {}) // merge**2 for i in images]


def expand_placeholders(tokenizer: Any, ids: list[int], counts: Sequence[int], *, where: str) -> list[int]:
    """:func:`expand_image_tokens` on the tokenizer's placeholder, its error starting with ``where``. Runs on: any
    process.

    Raises:
        ValueError: the rendered ids hold another number of placeholders than ``counts`` has images."""
    token = image_token(tokenizer)
    try:
        return expand_image_tokens(ids, int(tokenizer.convert_tokens_to_ids(token)), counts)
    except ValueError as err:
        raise ValueError(
            f"{where}: {err} (the rendered prompt must hold one {token!r} per image: the chat template places them). "
            "HINT: remove image tokens written into the text."
        ) from err


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
    """Refuse, before any model loads, what does not take a data module's image column: an environment (its ``reset``
    places the images in its messages) and sequence parallelism. ``setting`` names the data module's image setting in
    the message. Runs on: every process, in the data module's ``setup``."""
    if getattr(module, "environment", None) is not None:
        raise ValueError(
            f"PromptDataModule({setting}) with an environment: an episode's images are the ones its messages hold. "
            "HINT: drop image_column and have reset(row) return them as items of its messages, e.g. {'role': "
            "'user', 'content': [{'type': 'image', 'image': row['image']}, {'type': 'text', 'text': ...}]} (the row "
            "holds the dataset's columns); docs/vision.md."
        )
    if int(getattr(module, "sequence_parallel", 1) or 1) > 1:
        raise ValueError(
            f"PromptDataModule({setting}): prompts with images cannot run with RLHFModule(sequence_parallel="
            f"{module.sequence_parallel}) yet: each rank would need the whole image's features. HINT: "
            "sequence_parallel=1 for a vision-language run, docs/vision.md."
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

    def decode(self, row: dict[str, Any], *, index: int, which: str) -> list[Any]:
        """Row ``index``'s images as PIL RGB images (:func:`load_image` on each)."""
        value = row[self.column]
        values = value if isinstance(value, list) else [value]
        where = f"PromptDataModule({self.setting}): row {index} of the {which} data"
        return [load_image(v, where=where) for v in values]

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
        where = f"PromptDataModule({self.setting}): row {index} of the {which} data"
        return expand_placeholders(self.tokenizer, ids, patch_counts(self.image_processor, images), where=where)

    def inputs(self, rows: Sequence[dict[str, Any]]) -> list[VisionInputs]:
        """Each row's :class:`VisionInputs` (made per batch: the pixel values are not kept for the whole dataset)."""
        return [vision_inputs(self.image_processor, row[self.column]) for row in rows]


IMAGE_ITEM_KEYS = ("image", "path", "url")
"""Where a chat message's image item holds its image: ``{"type": "image", "image": PIL image or bytes}``, or a local
file under ``"path"`` or ``"url"`` (transformers' and TRL's forms)."""


class ChatImages:
    """Images inside an episode's chat messages (the messages of ``reset`` and the observations ``step`` or a loop
    returns), as ``{"type": "image", "image": ...}`` content items (:data:`IMAGE_ITEM_KEYS`): :meth:`split` decodes
    them and keeps the messages with bare ``{"type": "image"}`` items (what the chat template renders and the episode's
    messages keep), :meth:`expand` repeats each rendered placeholder once per merged patch and makes the processor's
    inputs. The image processor is loaded from ``model_path`` at the first image (a text episode never loads it).
    Runs on: the rollout's process, and every process in the data module's ``setup`` (the first prompts).

    Args:
        tokenizer: the actor's tokenizer (its image placeholder token).
        model_path: the actor's folder (its image processor; None: none, an image is refused).
    """

    def __init__(self, tokenizer: Any, model_path: str | None) -> None:
        self.tokenizer = tokenizer
        self.model_path = model_path
        self._processor: Any = None

    @property
    def image_processor(self) -> Any:
        """The actor's image processor, loaded on first use.

        Raises:
            ValueError: the actor has none (a text model given an image)."""
        if self._processor is None:
            from transformers import AutoImageProcessor

            try:
                if self.model_path is None:
                    raise ValueError("no model folder given")
                self._processor = AutoImageProcessor.from_pretrained(self.model_path)
            except (OSError, ValueError) as err:
                raise ValueError(
                    f"an episode's messages hold an image, and the actor ({self.model_path}) has no image processor "
                    f"({err}). HINT: use a vision-language actor (Qwen2-VL family), or keep images out of the "
                    "environment's messages."
                ) from err
        return self._processor

    @functools.cached_property
    def placeholder_id(self) -> int | None:
        """The tokenizer's image placeholder id (None: it has none)."""
        found = self.tokenizer.convert_tokens_to_ids(image_token(self.tokenizer))
        return None if found is None or found == getattr(self.tokenizer, "unk_token_id", None) else int(found)

    def split(self, messages: Sequence[dict[str, Any]], *, where: str) -> tuple[list[dict[str, Any]], list[Any]]:
        """``(messages with bare image items, their images decoded in order)``; ``where`` names the messages' source
        in errors.

        Raises:
            ValueError: an image item without an image, or one that cannot be decoded."""
        out: list[dict[str, Any]] = []
        images: list[Any] = []
        for message in messages:
            content = message.get("content")
            if not isinstance(content, list) or not any(_is_image_item(item) for item in content):
                out.append(dict(message))
                continue
            items = []
            for item in content:
                if not _is_image_item(item):
                    items.append(item)
                    continue
                value = next((item[k] for k in IMAGE_ITEM_KEYS if item.get(k) is not None), None)
                if value is None:
                    raise ValueError(
                        f"{where}: an image item {item!r:.80} holds no image. HINT: put the image under one of "
                        f"{list(IMAGE_ITEM_KEYS)}: {{'type': 'image', 'image': pil_image}}."
                    )
                images.append(load_image(value, where=where))
                items.append({"type": "image"})
            out.append({**message, "content": items})
        return out, images

    def expand(self, ids: list[int], images: Sequence[Any], *, where: str) -> tuple[list[int], VisionInputs]:
        """``(ids with each image's placeholder repeated once per merged patch, the images' processor inputs)``.

        Raises:
            ValueError: the rendered ids hold another number of placeholders than there are images."""
        inputs = vision_inputs(self.image_processor, images)
        counts = inputs.tokens_per_image(int(getattr(self.image_processor, "merge_size", 1)))
        return expand_placeholders(self.tokenizer, ids, counts, where=where), inputs


def _is_image_item(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == "image"
