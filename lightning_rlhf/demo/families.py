"""Real model families at full width with random weights, built locally (no hub): each family's architecture
fields transcribed from its published ``config.json``, a byte-level BPE tokenizer trained on local text with the
family's special tokens at their published ids and its chat template (:mod:`lightning_rlhf.demo.chat_templates`),
and the model's vocabulary kept at the family's (the tokenizer's ids are a subset). Depth is the one thing cut:
``layers`` (default :attr:`Family.cut`) of the published :attr:`Family.layers`. The support matrix is docs/models.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from tokenizers import Tokenizer, models, processors
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedTokenizerFast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lightning_rlhf.demo import chat_templates
from lightning_rlhf.demo.tiny import SPECIAL_TOKENS, _qwen2_pipeline, _trained_vocab_and_merges

__all__ = ["FAMILIES", "Family", "build_family", "build_family_tokenizer", "family_config"]

_QWEN_EXTRA = ("<tool_call>", "</tool_call>")


@dataclass(frozen=True)
class Family:
    """One family: ``config`` the published ``config.json`` fields (transcribed, depth excluded), ``layers`` its
    published depth, ``cut`` the depth the tests build, ``params`` the published parameter count at full depth,
    ``specials`` its special tokens at their published ids, ``bos``/``eos``/``pad`` their names (``None``: the
    family has none), ``added`` non-special added tokens with their ids, ``eos_ids`` the generation config's."""

    model_type: str
    config: dict[str, Any]
    layers: int
    cut: int
    params: int
    specials: dict[str, int]
    eos: str
    pad: str | None
    chat_template: str
    bos: str | None = None
    add_bos: bool = False
    added: dict[str, int] = field(default_factory=dict)
    eos_ids: tuple[int, ...] = ()


_QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
# Transcribed from the published config.json files (Hugging Face hub, instruct variants where the chat template
# comes from); shapes are checked by building the model (tests/unit/test_family_templates.py counts parameters).
FAMILIES: dict[str, Family] = {
    "qwen2.5-0.5b": Family(
        "qwen2",
        dict(
            hidden_size=896,
            intermediate_size=4864,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            hidden_act="silu",
            use_sliding_window=False,
            sliding_window=32768,
        ),
        layers=24,
        cut=2,
        params=494_032_768,
        specials=_QWEN_SPECIALS,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        chat_template=chat_templates.QWEN25,
        added={"<tool_call>": 151657, "</tool_call>": 151658},
        eos_ids=(151645, 151643),
    ),
    "qwen3-0.6b": Family(
        "qwen3",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            hidden_act="silu",
            attention_bias=False,
        ),
        layers=28,
        cut=2,
        params=596_049_920,
        specials=_QWEN_SPECIALS,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        chat_template=chat_templates.QWEN3,
        added={
            "<tool_call>": 151657,
            "</tool_call>": 151658,
            "<tool_response>": 151665,
            "</tool_response>": 151666,
            "<think>": 151667,
            "</think>": 151668,
        },
        eos_ids=(151645, 151643),
    ),
    "llama-3.2-1b": Family(
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            rope_scaling={
                "factor": 32.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            tie_word_embeddings=True,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
        ),
        layers=16,
        cut=2,
        params=1_235_814_400,
        specials={
            "<|begin_of_text|>": 128000,
            "<|end_of_text|>": 128001,
            "<|finetune_right_pad_id|>": 128004,
            "<|start_header_id|>": 128006,
            "<|end_header_id|>": 128007,
            "<|eom_id|>": 128008,
            "<|eot_id|>": 128009,
            "<|python_tag|>": 128010,
        },
        bos="<|begin_of_text|>",
        add_bos=True,
        eos="<|eot_id|>",
        pad="<|finetune_right_pad_id|>",
        chat_template=chat_templates.LLAMA32,
        eos_ids=(128001, 128008, 128009),
    ),
    "gemma-3-1b": Family(
        "gemma3_text",
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            vocab_size=262144,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rope_local_base_freq=10000.0,
            rms_norm_eps=1e-6,
            sliding_window=512,
            sliding_window_pattern=6,
            query_pre_attn_scalar=256,
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            attention_bias=False,
        ),
        layers=26,
        cut=2,
        params=999_885_952,
        specials={"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<start_of_turn>": 105, "<end_of_turn>": 106},
        bos="<bos>",
        add_bos=True,
        eos="<eos>",
        pad="<pad>",
        chat_template=chat_templates.GEMMA3,
        eos_ids=(1, 106),
    ),
    "mistral-7b-v0.3": Family(
        "mistral",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=32768,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-5,
            sliding_window=None,
            tie_word_embeddings=False,
            hidden_act="silu",
        ),
        layers=32,
        cut=1,
        params=7_248_023_552,
        specials={
            "<unk>": 0,
            "<s>": 1,
            "</s>": 2,
            "[INST]": 3,
            "[/INST]": 4,
            "[TOOL_CALLS]": 5,
            "[AVAILABLE_TOOLS]": 6,
            "[/AVAILABLE_TOOLS]": 7,
            "[TOOL_RESULTS]": 8,
            "[/TOOL_RESULTS]": 9,
        },
        bos="<s>",
        add_bos=True,
        eos="</s>",
        pad=None,
        chat_template=chat_templates.MISTRAL_V03,
        eos_ids=(2,),
    ),
    "smollm2-360m": Family(
        "llama",
        dict(
            hidden_size=960,
            intermediate_size=2560,
            num_attention_heads=15,
            num_key_value_heads=5,
            head_dim=64,
            vocab_size=49152,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
        ),
        layers=32,
        cut=4,
        params=361_821_120,
        specials={"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2},
        eos="<|im_end|>",
        pad="<|im_end|>",
        chat_template=chat_templates.SMOLLM2,
        eos_ids=(2,),
    ),
}
"""The catalogue, by name. ``cut``: 2 layers (Gemma-3: one sliding-window and one global layer), Mistral-7B's one
layer (its 4096 x 14336 MLP and untied 32,768-token head are 0.49B parameters already), SmolLM2's 4."""


def _family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}. HINT: one of {', '.join(sorted(FAMILIES))}.")
    return FAMILIES[name]


def _vocab(fam: Family) -> dict[str, int]:
    """The trained BPE's tokens placed around the family's special and added tokens (at their published ids), every
    other id of the model's vocabulary a never-produced ``<|reserved_N|>`` entry: any id a model samples decodes."""
    fixed = {**fam.specials, **fam.added}
    taken = set(fixed.values())
    trained = [t for t in _trained_vocab_and_merges_list() if t not in fixed]
    vocab, free = dict(fixed), (i for i in range(fam.config["vocab_size"]) if i not in taken)
    for token in trained:
        vocab[token] = next(free)
    for i in free:
        vocab[f"<|reserved_{i}|>"] = i
    return vocab


def _trained_vocab_and_merges_list() -> list[str]:
    """The tiny BPE's tokens (bytes and merges, its own special tokens dropped) in id order."""
    import json

    vocab = json.loads(_trained_vocab_and_merges()[0])
    return [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in SPECIAL_TOKENS]


def build_family_tokenizer(name: str, save_dir: str | os.PathLike[str] | None = None) -> PreTrainedTokenizerFast:
    """The family's tokenizer: the tiny byte-level BPE (:mod:`lightning_rlhf.demo.tiny`), the family's special
    tokens at their ids, its BOS rule and chat template. Runs on: any process (plain function)."""
    import json

    fam = _family(name)
    merges = [tuple(p) for p in json.loads(_trained_vocab_and_merges()[1])]
    backend = _qwen2_pipeline(Tokenizer(models.BPE(vocab=_vocab(fam), merges=merges, fuse_unk=False)))
    if fam.add_bos:
        bos = fam.bos or ""
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, fam.specials[bos])]
        )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=fam.bos,
        eos_token=fam.eos,
        pad_token=fam.pad,
        unk_token="<unk>" if "<unk>" in fam.specials else None,
        additional_special_tokens=[t for t in fam.specials if t not in (fam.bos, fam.eos, fam.pad, "<unk>")],
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=fam.config["max_position_embeddings"],
    )
    tok.add_tokens(list(fam.added))
    tok.chat_template = fam.chat_template
    if save_dir is not None:
        tok.save_pretrained(os.fspath(save_dir))
    return tok


def family_config(name: str, *, layers: int | None = None) -> PretrainedConfig:
    """The family's configuration with ``layers`` layers (default :attr:`Family.cut`; the published depth with
    ``layers=Family.layers``). Gemma-3 cut below its 6-layer period keeps a global layer last. Runs on: any process."""
    fam = _family(name)
    depth = fam.cut if layers is None else layers
    if depth < 1:
        raise ValueError(f"build_family({name!r}, layers={depth}): needs at least one layer")
    extra: dict[str, Any] = {}
    if fam.model_type == "gemma3_text" and depth < 6:
        extra["layer_types"] = ["sliding_attention"] * (depth - 1) + ["full_attention"]
    ids = {k: fam.specials.get(v) if v else None for k, v in (("bos", fam.bos), ("pad", fam.pad))}
    return AutoConfig.for_model(
        fam.model_type,
        architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[fam.model_type]],
        **fam.config,
        **extra,
        num_hidden_layers=depth,
        attention_dropout=0.0,
        bos_token_id=ids["bos"],
        pad_token_id=ids["pad"],
        eos_token_id=list(fam.eos_ids) if len(fam.eos_ids) > 1 else fam.specials[fam.eos],
    )


def build_family(
    name: str,
    path: str | os.PathLike[str],
    *,
    layers: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> str:
    """Save a randomly initialised ``name`` model (:func:`family_config`) and its tokenizer
    (:func:`build_family_tokenizer`) in ``path`` (safetensors); returns the folder. Runs on: any process."""
    config = family_config(name, layers=layers)
    out = os.fspath(path)
    os.makedirs(out, exist_ok=True)
    build_family_tokenizer(name, out)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = list(FAMILIES[name].eos_ids)
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    return out
