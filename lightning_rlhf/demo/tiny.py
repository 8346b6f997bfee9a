"""Tiny, randomly initialised, fully local models for tests and the embedded demo job.

Everything here is built in-process (no hub access): a small byte-level BPE tokenizer, trained on a fixed corpus
written below through exactly Qwen2's pre-tokenizer pipeline, and small causal LM / sequence-classifier models
whose vocabulary is that tokenizer's. The tokenizer reads any text (every byte has a token, so nothing maps to
``<unk>``), keeps each digit a token of its own (Qwen2's split regex, which the addition task relies on), and is a
``Qwen2Tokenizer``: the class transformers (and vLLM) reload any ``model_type=qwen2`` folder's tokenizer with, so
a saved tokenizer gives the same ids once reloaded."""

from __future__ import annotations

import functools
import json
import os
from typing import Any, cast

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
"""Special tokens, in id order: ``<pad>`` = 0, ``<s>`` = 1, ``</s>`` = 2, ``<unk>`` = 3 (byte-level BPE never
needs ``<unk>``; it is declared so that no loader adds a default unknown token of its own)."""
INIT_STD = 0.04
"""Standard deviation of the random initial weights (``initializer_range``; Qwen2's is 0.02). With a vocabulary
of about 400 tokens, the demo's warm start (40 SFT steps) reaches a sampled addition accuracy of about 0.14 from
0.02 and about 0.4 from 0.04: the partly-right policy RL needs, where the 18-token character vocabulary put it."""
MAX_POSITIONS = 256
"""``max_position_embeddings`` of the tiny models (and the tokenizer's ``model_max_length``): room for chat prompts
of a system and a user turn and their answer. Qwen2's positions are rotary, so no weight depends on it: a model
built with another value has the same weights."""
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The tiny tokenizer's chat template (Zephyr's layout): ``<s>``, then each turn as ``<|role|>`` and a newline,
its content, ``</s>`` and a newline; with ``add_generation_prompt=True`` it ends with ``<|assistant|>`` and a
newline, so the model's answer comes next and ends with ``</s>``, the EOS that stops generation. A system and
a user turn render as ``<s><|system|>\\nBe brief.</s>\\n<|user|>\\n3+4=</s>\\n<|assistant|>\\n``. The role markers
are plain text (no new tokens: the vocabulary and so the weights stay as they were), and any role name renders
the same way. Rendering the turns before an assistant turn with the generation prompt gives a prefix of the
rendering with that turn (what SFT on chats needs)."""
VOCAB_SIZE = 512
"""Target vocabulary of the BPE training: 4 special tokens, the 256 byte tokens, and merges up to 512 (fewer
when the corpus runs out of pairs seen twice)."""

_ENGLISH = """\
Which is larger? Which is smaller? What is the sum, the difference, the product? Answer with a number.
The answer is correct. The answer is wrong. Think step by step, then write the final answer.
Question: Tom has 3 apples and buys 4 more. How many apples does he have now? Answer: 7.
Question: A train leaves at 9 and arrives at 11. How long is the trip? Answer: 2 hours.
Please write a short story about a cat, a dog and a bird who live in a small house by the sea.
The quick brown fox jumps over the lazy dog. She said: "It's a good day, isn't it?" and we agreed.
You are a helpful assistant. The user asks a question and the assistant answers it politely and clearly.
Reinforcement learning from human feedback trains a policy to maximise a reward while staying close to
a reference model. Each prompt is sampled several times, and the samples are scored and compared.
"""


def _training_corpus() -> list[str]:
    """The fixed corpus of the tiny BPE: the demo's additions, number comparisons and some English."""
    lines = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
    lines += [f"{a}+{b}=" for a in range(100) for b in range(0, 100, 7)]
    lines += [f"Which is larger, {a} or {b}? Answer: {max(a, b)}" for a in range(0, 100, 3) for b in (19, 41, 77)]
    lines += _ENGLISH.splitlines()
    return lines


def _qwen2_pipeline(backend: Tokenizer) -> Tokenizer:
    """Qwen2's normalizer, pre-tokenizer and decoder (as ``Qwen2Tokenizer.__init__`` rebuilds them on load)."""
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


@functools.lru_cache(maxsize=1)
def _trained_vocab_and_merges() -> tuple[str, str]:
    """Trains the BPE once per process; returns ``(vocab, merges)`` as JSON text (deterministic)."""
    backend = _qwen2_pipeline(
        Tokenizer(
            models.BPE(
                dropout=None,
                unk_token=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
                byte_fallback=False,
            )
        )
    )
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_training_corpus(), trainer=trainer)
    model = json.loads(backend.to_str())["model"]
    return json.dumps(model["vocab"]), json.dumps(model["merges"])


def build_tiny_tokenizer(save_dir: str | os.PathLike[str] | None = None) -> Qwen2Tokenizer:
    """Builds the byte-level BPE tokenizer of the tiny models (about 500 tokens), trained locally (see the module
    docstring): the same in every process and on every machine. Encoding with ``add_special_tokens=True`` prepends
    ``<s>`` (no ``</s>`` is appended); padding is on the left; ``model_max_length`` is :data:`MAX_POSITIONS`; the chat
    template is :data:`CHAT_TEMPLATE`. Runs on: any process (plain function; the training takes a few milliseconds and
    is cached per process).

    Args:
        save_dir: If given, the tokenizer is written there with ``save_pretrained``; the folder reloads with
            ``AutoTokenizer.from_pretrained(save_dir)`` (and in vLLM) as the same tokenizer, giving the same ids.
    """
    vocab, merges = _trained_vocab_and_merges()
    pairs: Any = [tuple(pair) for pair in json.loads(merges)]  # (left, right) pairs, as tokenizers' BPE takes them
    tokenizer = Qwen2Tokenizer(
        vocab=json.loads(vocab),
        merges=pairs,
        unk_token=UNK_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        add_bos_token=True,
        add_eos_token=False,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(os.fspath(save_dir))
    return tokenizer


def _build(
    auto_class: Any,
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    seed: int,
    model_type: str,
    max_positions: int,
    **extra: Any,
) -> PreTrainedModel:
    """``auto_class.from_config`` of the tiny config (see :func:`build_tiny_model`), initialised with ``seed``."""
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=-(-len(tokenizer) // 8) * 8,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        initializer_range=INIT_STD,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )
    return seeded_model(auto_class, config, tokenizer, seed=seed)


def seeded_model(auto_class: Any, config: Any, tokenizer: PreTrainedTokenizerBase, *, seed: int) -> PreTrainedModel:
    """``auto_class.from_config(config)`` initialised with ``seed`` (the global RNG left as it was), float32, in eval
    mode, its generation config holding ``tokenizer``'s special ids. Runs on: any process."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = auto_class.from_config(config, dtype=torch.float32)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.pad_token_id = tokenizer.pad_token_id
        gen.bos_token_id = tokenizer.bos_token_id
        gen.eos_token_id = tokenizer.eos_token_id
    return cast(PreTrainedModel, model.float().eval())


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
    max_positions: int = MAX_POSITIONS,
) -> PreTrainedModel:
    """Builds a randomly initialised tiny causal LM (default: ``Qwen2ForCausalLM``, ~345k parameters).

    Tied input/output embeddings, ``head_dim = hidden_size // num_heads`` (32 by default), no dropout, vocabulary
    ``len(tokenizer)`` rounded up to a multiple of 8, and pad/bos/eos ids taken from ``tokenizer`` (also in the
    generation config). Float32, eval mode. Runs on: any process (plain function).

    Args:
        tokenizer: The tokenizer the model is for (usually :func:`build_tiny_tokenizer`).
        hidden_size: Model width. Below 128 the demo task does not learn reliably.
        num_kv_heads: Key/value heads (grouped-query attention).
        intermediate_size: MLP width.
        seed: Seed of the random initialisation (the global RNG state is left untouched).
        model_type: A transformers ``model_type`` with a causal-LM class (``"qwen2"``, ``"llama"``, ...).
        max_positions: ``max_position_embeddings``: the longest prompt + response the model takes. The weights
            do not depend on it (rotary positions), so a shorter one is a cheap way to test length checks.
    """
    return _build(
        AutoModelForCausalLM,
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        seed=seed,
        model_type=model_type,
        max_positions=max_positions,
    )


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
    max_positions: int = MAX_POSITIONS,
) -> PreTrainedModel:
    """Builds a randomly initialised tiny sequence classifier with one output (a reward/value model): the backbone and
    arguments of :func:`build_tiny_model` (default ``Qwen2ForSequenceClassification``) with ``num_labels=1`` and
    ``pad_token_id`` set, so the score is read at the last non-pad token. Runs on: any process (plain function)."""
    return _build(
        AutoModelForSequenceClassification,
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        seed=seed,
        model_type=model_type,
        max_positions=max_positions,
        num_labels=1,
    )


def save_tiny(model_dir: str | os.PathLike[str], *, seed: int = 0, classifier: bool = False, **kw: Any) -> str:
    """Builds the tiny tokenizer and a tiny model (:func:`build_tiny_model`, or :func:`build_tiny_classifier` with
    ``classifier=True``; ``kw`` their further arguments) and saves both into ``model_dir`` (created if missing;
    safetensors), a folder loadable like any local checkpoint; returns it as a string. Well under a second. Runs on: any
    process (plain function)."""
    path = os.fspath(model_dir)
    os.makedirs(path, exist_ok=True)
    tokenizer = build_tiny_tokenizer(path)
    build = build_tiny_classifier if classifier else build_tiny_model
    model = build(tokenizer, seed=seed, **kw)
    model.save_pretrained(path, safe_serialization=True)
    return path
