"""A tiny, randomly initialised Qwen2-VL (vision tower + language model) with its processor, built locally.

The language model's vocabulary is the tiny byte-level tokenizer's (:mod:`lightning_rlhf.demo.tiny`) plus Qwen2-VL's
four vision tokens; the processor is transformers' ``Qwen2VLProcessor`` with the PIL image processor (no torchvision
needed) and a chat template that renders an image item of a message as ``<|vision_start|><|image_pad|><|vision_end|>``
(the processor then repeats ``<|image_pad|>`` once per merged patch). Saved with :func:`save_tiny_vlm`, the folder
loads in transformers (``AutoModelForImageTextToText``, ``AutoProcessor``) and in vLLM like a hub Qwen2-VL.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import AutoConfig, PreTrainedModel

from lightning_rlhf.demo.tiny import INIT_STD, build_tiny_tokenizer, seeded_model

__all__ = [
    "IMAGE_PAD",
    "VISION_CHAT_TEMPLATE",
    "VISION_TOKENS",
    "build_tiny_vlm",
    "build_tiny_vlm_processor",
    "save_tiny_vlm",
]

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
"""Qwen2-VL's vision tokens, added to the tiny tokenizer as special tokens in this order."""
VISION_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The tiny tokenizer's chat template (:data:`lightning_rlhf.demo.tiny.CHAT_TEMPLATE`) where a message's content may
also be a list of items, ``{"type": "image"}`` and ``{"type": "text", "text": ...}``, as Qwen2-VL's template takes."""
IMAGE_SIZE = 56
"""The processor's fixed image side in pixels: 4 x 4 patches of 14 pixels, merged 2 x 2 into 4 image tokens."""


def build_tiny_vlm_processor(save_dir: str | os.PathLike[str] | None = None, *, model_type: str = "qwen2_vl") -> Any:
    """The tiny tokenizer with the vision tokens, wrapped in the family's processor (``Qwen2VLProcessor``, or
    ``Qwen2_5_VLProcessor`` for ``model_type="qwen2_5_vl"``) whose image processor resizes every image to
    :data:`IMAGE_SIZE` square (``min_pixels = max_pixels``). Runs on: any process."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = build_tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    pixels = IMAGE_SIZE * IMAGE_SIZE
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=pixels, max_pixels=pixels, size={"shortest_edge": pixels, "longest_edge": pixels}
    )
    processor_class = Qwen2_5_VLProcessor if model_type == "qwen2_5_vl" else Qwen2VLProcessor
    processor = processor_class(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=VISION_CHAT_TEMPLATE,
    )
    if save_dir is not None:
        processor.save_pretrained(os.fspath(save_dir))
    return processor


def build_tiny_vlm(
    processor: Any,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_depth: int = 2,
    seed: int = 0,
    model_type: str = "qwen2_vl",
) -> PreTrainedModel:
    """A randomly initialised ``Qwen2VLForConditionalGeneration`` (or, ``model_type="qwen2_5_vl"``,
    ``Qwen2_5_VLForConditionalGeneration``: RMS norms and gated MLPs in the tower, windowed attention but in its last
    block) for ``processor``'s tokenizer: a language model of ``hidden_size`` (heads of 32: vLLM's CPU attention takes
    no smaller) and a vision tower of ``vision_depth`` blocks of width 64, patches of 14 pixels merged 2 x 2. Runs on:
    any process."""
    from transformers import AutoModelForImageTextToText

    tok = processor.tokenizer
    ids = {
        name: tok.convert_tokens_to_ids(token)
        for name, token in zip(("start", "end", "image", "video"), VISION_TOKENS, strict=True)
    }
    head_dim = 32
    heads = hidden_size // head_dim
    config = AutoConfig.for_model(
        model_type,
        text_config={
            "vocab_size": -(-len(tok) // 8) * 8,
            "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            "initializer_range": INIT_STD,
            "tie_word_embeddings": True,
            "pad_token_id": tok.pad_token_id,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
        },
        vision_config=_vision_config(model_type, vision_depth, hidden_size),
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["start"],
        vision_end_token_id=ids["end"],
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return seeded_model(AutoModelForImageTextToText, config, tok, seed=seed)


def _vision_config(model_type: str, depth: int, out_size: int) -> dict[str, Any]:
    """The tiny tower: width 64, 2 heads of 32, patches of 14 merged 2 x 2, into the language model's width."""
    common: dict[str, Any] = {"depth": depth, "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2}
    common |= {"temporal_patch_size": 2, "initializer_range": INIT_STD}
    if model_type == "qwen2_5_vl":
        window = {"window_size": 56, "fullatt_block_indexes": [depth - 1]}
        return common | window | {"hidden_size": 64, "intermediate_size": 128, "out_hidden_size": out_size}
    return common | {"embed_dim": 64, "hidden_size": out_size, "mlp_ratio": 2}


def save_tiny_vlm(model_dir: str | os.PathLike[str], *, seed: int = 0, model_type: str = "qwen2_vl", **kw: Any) -> str:
    """Build the tiny processor and VLM of ``model_type`` (``"qwen2_vl"`` or ``"qwen2_5_vl"``) and save both
    (safetensors) to ``model_dir``; returns the path. Runs on: any process."""
    path = os.fspath(model_dir)
    processor = build_tiny_vlm_processor(path, model_type=model_type)
    build_tiny_vlm(processor, seed=seed, model_type=model_type, **kw).save_pretrained(path)
    return path
