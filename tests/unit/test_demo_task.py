"""Tests of the embedded demo pieces: tiny models, addition task, warm start (the tokenizer: test_tiny_tokenizer.py)."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from lightning_rlhf.config.models import CACHE_ENV
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
from lightning_rlhf.demo.tiny import CHAT_TEMPLATE, MAX_POSITIONS
from lightning_rlhf.demo.warmstart import CACHE_VERSION, warm_start
from tests.conftest import failure_text, run_cli


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
    assert AutoConfig.from_pretrained(path).max_position_embeddings == MAX_POSITIONS == 256
    assert AutoTokenizer.from_pretrained(path).chat_template == CHAT_TEMPLATE  # kept through the warm start's export
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "temp dir left behind"
    acc = sampled_accuracy(path, num_samples=4)
    assert 0.2 <= acc <= 0.8

    weights = os.stat(os.path.join(path, "model.safetensors"))
    assert prepare_demo_model(str(tmp_path)) == path  # a cache hit (its time: benchmarks/bench_overheads.py) ...
    again = os.stat(os.path.join(path, "model.safetensors"))
    assert (again.st_ino, again.st_mtime_ns) == (weights.st_ino, weights.st_mtime_ns), "... rebuilt the model"


def test_positions_change_no_weight() -> None:
    """256 positions instead of 64 (issue 31): Qwen2's rotary positions have no weights, so the models built with
    either are the same, parameter for parameter (the demo's warm start and curve start from the same model)."""
    tok = build_tiny_tokenizer()
    for build in (build_tiny_model, build_tiny_classifier):
        short, long = build(tok, max_positions=64), build(tok)
        assert (short.config.max_position_embeddings, long.config.max_position_embeddings) == (64, 256)
        assert short.state_dict().keys() == long.state_dict().keys()
        for name, value in long.state_dict().items():
            assert torch.equal(value, short.state_dict()[name]), name


@pytest.mark.slow
def test_warm_start_is_the_same_with_64_positions(demo_model: str, tmp_path: Path) -> None:
    """The embedded ``tiny-addition`` (256 positions, chat template) has exactly the weights that the warm start
    of the 64-position model gives: the SFT warm start, and so the demo's RL run from it, is unchanged."""
    base = save_tiny(tmp_path / "base64", seed=0, max_positions=64)
    old = warm_start(base, str(tmp_path / "ws64"), steps=40, seed=0)
    assert AutoConfig.from_pretrained(old).max_position_embeddings == 64
    before, after = load_file(os.path.join(old, "model.safetensors")), load_file(f"{demo_model}/model.safetensors")
    assert before.keys() == after.keys()
    for name, value in after.items():
        assert torch.equal(value, before[name]), name


@pytest.mark.slow
def test_chat_prompts_train_on_the_embedded_model_as_shipped(
    demo_model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's chat task (issue 31): a system and a user turn per prompt, GRPO with ``lightning-rlhf fit`` and
    YAML only, on ``lightning-rlhf/tiny-addition`` as shipped (its own chat template, no copy of the model)."""
    system = "You add numbers. Write only the sum."
    chats = [
        {"messages": [{"role": "system", "content": system}, {"role": "user", "content": f"{a}+{b}="}],
         "answer": str(a + b)}
        for a in range(4) for b in range(4)
    ]  # fmt: skip
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in chats))
    monkeypatch.setenv(CACHE_ENV, str(Path(demo_model).parent))  # the embedded name resolves to demo_model
    proc = run_cli(
        "fit", "--config", "recipes/demo.yaml",
        "--data.train", str(data), "--data.messages_column", "messages", "--data.max_prompt_length", "96",
        "--data.batch_size", "4", "--model.rollout.n", "4", "--model.algorithm.batching.micro_batch_size", "16",
        "--trainer.devices", "1", "--trainer.strategy.rollout", "hf", "--trainer.max_steps", "2",
        "--trainer.logger.init_args.save_dir", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, failure_text(proc)
    with open(tmp_path / "demo" / "version_0" / "metrics.csv") as f:
        scores = [float(r["critic/score/mean"]) for r in csv.DictReader(f) if r.get("critic/score/mean")]
    assert len(scores) == 2 and all(0.0 <= s <= 1.0 for s in scores)
