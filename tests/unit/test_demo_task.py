"""Tests of the embedded demo pieces: tiny models, addition task, warm start (the tokenizer: test_tiny_tokenizer.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_rlhf.demo import (
    addition_dataset,
    addition_reward,
    build_tiny_classifier,
    build_tiny_model,
    build_tiny_tokenizer,
    prepare_demo_model,
    sampled_accuracy,
    save_tiny,
)
from lightning_rlhf.demo.warmstart import CACHE_VERSION


def test_tiny_model_forward_and_size() -> None:
    tok = build_tiny_tokenizer()
    model = build_tiny_model(tok)
    n_params = sum(p.numel() for p in model.parameters())
    assert 300_000 < n_params < 400_000
    assert model.config.tie_word_embeddings
    assert model.config.vocab_size % 8 == 0 and model.config.vocab_size >= len(tok)
    assert model.config.eos_token_id == tok.eos_token_id
    enc = tok(["3+4=", "5+5="], return_tensors="pt")
    logits = model(**enc).logits
    assert logits.shape == (2, 5, model.config.vocab_size)
    # Same seed, same weights.
    other = build_tiny_model(tok)
    assert torch.equal(model.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_tiny_classifier_scores() -> None:
    tok = build_tiny_tokenizer()
    model = build_tiny_classifier(tok)
    enc = tok(["3+4=7", "12+3=15"], padding=True, return_tensors="pt")
    assert model(**enc).logits.shape == (2, 1)


def test_save_tiny_is_loadable(tmp_path: Path) -> None:
    path = save_tiny(tmp_path / "m", seed=1)  # its time: benchmarks/bench_overheads.py
    assert os.path.isfile(os.path.join(path, "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.pad_token_id == 0


@pytest.mark.parametrize(
    ("completion", "expected"),
    [("7", 1.0), (" 7\n", 1.0), ("77", 0.0), ("7+", 0.0), ("", 0.0), ("8", 0.0), ("07", 0.0)],
)
def test_addition_reward(completion: str, expected: float) -> None:
    assert addition_reward(["3+4="], [completion], answer=["7"]) == [expected]


def test_addition_reward_batch_and_extra_columns() -> None:
    rewards = addition_reward(["1+1=", "9+9="], ["2", "17"], answer=["2", "18"], other=[0, 1])
    assert rewards == [1.0, 0.0]


def test_addition_dataset() -> None:
    ds = addition_dataset()
    assert len(ds) == 100
    assert set(ds.column_names) == {"prompt", "answer"}
    assert {(p, a) for p, a in zip(ds["prompt"], ds["answer"], strict=True)} >= {
        ("3+4=", "7"),
        ("9+9=", "18"),
    }
    assert len(set(ds["prompt"])) == 100
    two = addition_dataset(num_prompts=50, digits=2, seed=3)
    assert len(two) == 50 and two["prompt"] == addition_dataset(num_prompts=50, digits=2, seed=3)["prompt"]
    for p, a in zip(two["prompt"], two["answer"], strict=True):
        x, y = p.rstrip("=").split("+")
        assert int(x) + int(y) == int(a)


def test_prepare_demo_model_is_warm_and_cached(tmp_path: Path) -> None:
    path = prepare_demo_model(str(tmp_path))
    assert os.path.basename(path) == f"demo-model-{CACHE_VERSION}-seed0-ws40"
    assert os.path.isfile(os.path.join(path, "config.json"))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "temp dir left behind"
    acc = sampled_accuracy(path, num_samples=4)
    assert 0.2 <= acc <= 0.8

    weights = os.stat(os.path.join(path, "model.safetensors"))
    assert prepare_demo_model(str(tmp_path)) == path  # a cache hit (its time: benchmarks/bench_overheads.py) ...
    again = os.stat(os.path.join(path, "model.safetensors"))
    assert (again.st_ino, again.st_mtime_ns) == (weights.st_ino, weights.st_mtime_ns), "... rebuilt the model"
