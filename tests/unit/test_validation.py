"""Validation metrics: mean@N and the unbiased pass@k against values worked out by hand, the settings' checks,
and the metrics a validation batch logs."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rlhf import Batch, GRPOModule, ValidationConfig
from lightning_rlhf.algorithms import mean_at_n, pass_at_k
from lightning_rlhf.demo import addition_reward


def test_mean_at_n_by_hand() -> None:
    scores = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 0.3]])
    assert mean_at_n(scores).tolist() == pytest.approx([0.5, 0.5, 0.075])
    assert mean_at_n(torch.tensor([[1], [0]])).dtype == torch.float32  # integer scores are averaged as floats


def test_pass_at_k_by_hand() -> None:
    # N = 4 samples per prompt, c passing: pass@k = 1 - C(4 - c, k) / C(4, k).
    passed = torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert pass_at_k(passed, k=1).tolist() == pytest.approx([0.0, 1 / 4, 2 / 4, 1.0])  # c / N
    # c=1: 1 - C(3,2)/C(4,2) = 1 - 3/6; c=2: 1 - C(2,2)/C(4,2) = 1 - 1/6.
    assert pass_at_k(passed, k=2).tolist() == pytest.approx([0.0, 1 / 2, 5 / 6, 1.0])
    # c=1: 1 - C(3,3)/C(4,3) = 1 - 1/4; c=2: N - c = 2 < k = 3, so any 3 draws include a pass.
    assert pass_at_k(passed, k=3).tolist() == pytest.approx([0.0, 3 / 4, 1.0, 1.0])
    assert pass_at_k(passed, k=4).tolist() == pytest.approx([0.0, 1.0, 1.0, 1.0])  # all N: any pass


def test_pass_at_k_matches_the_binomial_formula_for_large_n() -> None:
    n = 200
    counts = [0, 1, 7, 50, 199, 200]
    passed = torch.zeros(len(counts), n, dtype=torch.bool)
    for row, c in enumerate(counts):
        passed[row, torch.randperm(n, generator=torch.Generator().manual_seed(row))[:c]] = True  # order is irrelevant
    for k in (1, 10, 100):
        expected = [1.0 - math.comb(n - c, k) / math.comb(n, k) for c in counts]
        assert pass_at_k(passed, k=k).tolist() == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError, match=r"k=5 must be in 1..N=4"):
        pass_at_k(torch.ones(2, 4, dtype=torch.bool), k=5)


def test_validation_config_checks() -> None:
    assert ValidationConfig().ks == (1,)  # greedy, one answer per prompt
    assert ValidationConfig(n=8, temperature=0.6).ks == (1, 8)
    assert ValidationConfig(n=8, temperature=0.6, pass_k=(4, 1, 4)).ks == (1, 4)
    with pytest.raises(ValueError, match=r"ValidationConfig.n=4 is invalid: expected 1 with temperature=0"):
        ValidationConfig(n=4)
    with pytest.raises(
        ValueError, match=r"ValidationConfig.pass_k=\(5,\) is invalid: expected None or values in 1..n=4"
    ):
        ValidationConfig(n=4, temperature=1.0, pass_k=(5,))
    with pytest.raises(ValueError, match=r"ValidationConfig.temperature=-1.0 is invalid"):
        ValidationConfig(temperature=-1.0)
    with pytest.raises(ValueError, match=r"ValidationConfig.pass_threshold=nan is invalid"):
        ValidationConfig(pass_threshold=float("nan"))


def test_validation_metrics_of_a_scored_rollout(tiny_model: str) -> None:
    module = GRPOModule(
        tiny_model,
        reward=addition_reward,
        validation=ValidationConfig(n=3, temperature=1.0, pass_k=(1, 2), pass_threshold=0.5),
    )
    # Two prompts x 3 samples, prompt-major as actor.generate lays them out.
    scores = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 0.8])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 0, 0]])
    out = module.validation_metrics(Batch({"scores": scores, "response_mask": mask}))
    assert out["val/score/mean"] == pytest.approx(2.3 / 6)
    assert out["val/mean@3"] == pytest.approx((1.5 / 3 + 0.8 / 3) / 2)
    # Passing (score > 0.5): one sample of each prompt. pass@1 = 1/3; pass@2 = 1 - C(2,2)/C(3,2) = 2/3.
    assert out["val/pass@1"] == pytest.approx(1 / 3)
    assert out["val/pass@2"] == pytest.approx(2 / 3)
    assert out["val/response_length/mean"] == pytest.approx((2 + 1 + 3 + 1 + 2 + 1) / 6)
    assert set(out) == {"val/score/mean", "val/mean@3", "val/pass@1", "val/pass@2", "val/response_length/mean"}
