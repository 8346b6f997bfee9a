"""Random Qwen2 causal LMs with the project's tiny byte-level BPE tokenizer, for the benchmark scripts.

Imported by the scripts next to it (``benchmarks/`` is their ``sys.path[0]`` when run as scripts).
"""

from __future__ import annotations

import os
from typing import Any


def save_qwen2(path: str, *, vocab_size: int, max_positions: int, seed: int = 0, **shape: Any) -> str:
    """Save a randomly initialised float32 Qwen2 causal LM (tied embeddings, 4 query / 2 KV heads unless ``shape``
    says otherwise) and the tiny tokenizer under ``path``; returns ``path``. Runs on: the calling process.

    Args:
        path: the folder to write (created).
        vocab_size: vocabulary of the model (the tokenizer's ids must fit in it).
        max_positions: ``max_position_embeddings``.
        seed: torch seed of the initialisation.
        **shape: ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``head_dim`` and any other
            ``Qwen2Config`` field.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lightning_rlhf.demo.tiny import build_tiny_tokenizer

    os.makedirs(path, exist_ok=True)
    tok = build_tiny_tokenizer(path)
    fields: dict[str, Any] = {"num_attention_heads": 4, "num_key_value_heads": 2} | shape
    config = Qwen2Config(
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        initializer_range=0.04,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **fields,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).float().save_pretrained(path, safe_serialization=True)
    return path
