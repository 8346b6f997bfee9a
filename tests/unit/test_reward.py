"""Reward role: function rewards are validated; reward models score decoded text."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoTokenizer

from lightning_rlhf.batch import Batch
from lightning_rlhf.roles import RewardFunctionError, RewardRole


def rollout(tok, completions: list[str]) -> Batch:
    ids = [tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for c in completions]
    width = max(len(i) for i in ids)
    responses = torch.zeros((len(ids), width), dtype=torch.long)
    mask = torch.zeros_like(responses)
    for k, row in enumerate(ids):
        responses[k, : len(row)] = torch.tensor(row)
        mask[k, : len(row)] = 1
    return Batch(
        {"responses": responses, "response_mask": mask},
        {"prompt": ["3+4="] * len(ids), "answer": ["7"] * len(ids)},
    )


def test_function_reward_gets_text_and_dataset_columns(tiny_model: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    seen = {}

    def fn(prompts, completions, answer, **kw):
        seen.update(prompts=prompts, completions=completions, answer=answer)
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    out = RewardRole(fn, tokenizer=tok, micro_batch_size=4).score(rollout(tok, ["7", "8"]))
    assert out["scores"].tolist() == [1.0, 0.0]
    assert out["completion"] == ["7", "8"]  # decoded without the EOS
    assert seen["prompts"] == ["3+4=", "3+4="] and seen["answer"] == ["7", "7"]


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda p, c, **kw: 1 / 0, r"reward function `<lambda>` raised ZeroDivisionError"),
        (lambda p, c, **kw: [1.0], r"returned 1 values for 2 completions"),
        (lambda p, c, **kw: [1.0, math.nan], r"returned nan for completion 1"),
        (lambda p, c, **kw: [math.inf, 0.0], r"returned inf for completion 0"),
        (lambda p, c, **kw: 1.0, r"returned float; expected a list of 2 floats"),
        (lambda p, c, **kw: ["x", 1.0], r"returned 'x' for completion 0"),
    ],
)
def test_bad_reward_functions_fail_clearly(tiny_model: str, fn, match: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    with pytest.raises(RewardFunctionError, match=match):
        RewardRole(fn, tokenizer=tok, micro_batch_size=4).score(rollout(tok, ["7", "8"]))


def test_reward_model_scores_each_text_batched(tiny_model: str, tiny_classifier: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    role = RewardRole(tiny_classifier, tokenizer=tok, micro_batch_size=2)
    role.load()
    batch = rollout(tok, ["7", "12", "7", "3"])
    scores = role.score(batch)["scores"]
    assert scores.shape == (4,) and torch.isfinite(scores).all()
    assert scores[0] == pytest.approx(scores[2].item(), abs=1e-5)  # same text, same score, any batch position
    assert scores[0] != pytest.approx(scores[1].item(), abs=1e-6)
