"""Tiny, randomly initialised, fully local models for tests and the embedded demo job.

Everything here is built in-process (no hub access): a character-level tokenizer and small causal LM /
sequence-classifier models whose vocabulary is that tokenizer's.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
"""Special tokens, in id order: ``<pad>`` = 0, ``<s>`` = 1, ``</s>`` = 2, ``<unk>`` = 3."""
CHARACTERS: tuple[str, ...] = tuple("0123456789+-*=")
"""The ordinary characters of the vocabulary (ids 4..17)."""


def build_char_tokenizer(save_dir: str | None = None) -> PreTrainedTokenizerFast:
    """Builds the character-level tokenizer of the tiny models (18 tokens).

    Every character is one token (``0-9 + - * =``; anything else maps to ``<unk>``). Encoding with
    ``add_special_tokens=True`` prepends ``<s>`` (no ``</s>`` is appended); decoding joins tokens with no
    separator, so ``decode(ids, skip_special_tokens=True)`` gives back the plain text. Padding is on the
    left.

    Runs on: any process (plain function).

    Args:
        save_dir: If given, the tokenizer is written there with ``save_pretrained`` (reloadable with
            ``AutoTokenizer.from_pretrained(save_dir)``).

    Returns:
        The tokenizer, with ``pad_token`` / ``bos_token`` / ``eos_token`` / ``unk_token`` set.
    """
    vocab = {token: idx for idx, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B",
        special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])],
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=64,
    )
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
    return tokenizer


def _model_config(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    model_type: str,
    **extra: Any,
) -> PretrainedConfig:
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    vocab_size = -(-len(tokenizer) // 8) * 8
    return AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )


def _finish(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.pad_token_id = tokenizer.pad_token_id
        gen.bos_token_id = tokenizer.bos_token_id
        gen.eos_token_id = tokenizer.eos_token_id
    return model.float().eval()


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    seed: int = 0,
    model_type: str = "qwen2",
) -> PreTrainedModel:
    """Builds a randomly initialised tiny causal LM (default: ``Qwen2ForCausalLM``, ~299k parameters).

    Tied input/output embeddings, ``head_dim = hidden_size // num_heads`` (32 by default), no dropout,
    ``max_position_embeddings=64``, vocabulary ``len(tokenizer)`` rounded up to a multiple of 8, and
    pad/bos/eos ids taken from ``tokenizer`` (also in the generation config). Float32, eval mode.

    Runs on: any process (plain function).

    Args:
        tokenizer: The tokenizer the model is for (usually :func:`build_char_tokenizer`).
        hidden_size: Model width. Below 128 the demo task does not learn reliably.
        num_layers: Number of decoder layers.
        num_heads: Number of attention heads.
        num_kv_heads: Number of key/value heads (grouped-query attention).
        intermediate_size: MLP width.
        seed: Seed of the random initialisation (the global RNG state is left untouched).
        model_type: A transformers ``model_type`` with a causal-LM class (``"qwen2"``, ``"llama"``, ...).

    Returns:
        The model.
    """
    config = _model_config(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        model_type=model_type,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _finish(model, tokenizer)


def build_tiny_classifier(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    seed: int = 0,
    model_type: str = "qwen2",
) -> PreTrainedModel:
    """Builds a randomly initialised tiny sequence classifier with one output (a reward/value model).

    Same backbone as :func:`build_tiny_model` (default ``Qwen2ForSequenceClassification``) with
    ``num_labels=1`` and ``pad_token_id`` set, so the score is read at the last non-pad token.

    Runs on: any process (plain function).

    Args:
        tokenizer: The tokenizer the model is for (usually :func:`build_char_tokenizer`).
        hidden_size: Model width.
        num_layers: Number of decoder layers.
        num_heads: Number of attention heads.
        num_kv_heads: Number of key/value heads.
        intermediate_size: MLP width.
        seed: Seed of the random initialisation (the global RNG state is left untouched).
        model_type: A transformers ``model_type`` with a sequence-classification class.

    Returns:
        The model.
    """
    config = _model_config(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        model_type=model_type,
        num_labels=1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    return _finish(model, tokenizer)


def save_tiny(model_dir: str | os.PathLike[str], *, seed: int = 0, classifier: bool = False, **kw: Any) -> str:
    """Builds the char tokenizer and a tiny model and saves both into ``model_dir`` (safetensors).

    The directory can then be loaded like any local checkpoint (``AutoTokenizer.from_pretrained``,
    ``AutoModelForCausalLM.from_pretrained``). Takes well under a second.

    Runs on: any process (plain function).

    Args:
        model_dir: Output directory (created if missing).
        seed: Seed of the random initialisation.
        classifier: Save a :func:`build_tiny_classifier` (one-output sequence classifier) instead of a
            causal LM.
        **kw: Further keyword arguments of :func:`build_tiny_model` / :func:`build_tiny_classifier`
            (``hidden_size``, ``num_layers``, ...).

    Returns:
        ``model_dir`` as a string.
    """
    path = os.fspath(model_dir)
    os.makedirs(path, exist_ok=True)
    tokenizer = build_char_tokenizer(path)
    build = build_tiny_classifier if classifier else build_tiny_model
    model = build(tokenizer, seed=seed, **kw)
    model.save_pretrained(path, safe_serialization=True)
    return path
