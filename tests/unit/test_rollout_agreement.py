"""The engine/trainer agreement metrics: in probability space (verl's), in log-probability space and as a mismatch
KL, so that a wrong model shows at any vocabulary size."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rlhf.algorithms import mismatch_metrics, rollout_log_ratio
from lightning_rlhf.roles.actor import rollout_probs_diff


def test_a_gap_between_unlikely_tokens_shows_in_log_space_not_in_probabilities() -> None:
    # Tokens of a 150k vocabulary: each about 7e-6 likely. The engine's log-probs are off by 0.5 nats on one token.
    train = torch.full((2, 3), -math.log(150_000))
    engine = train.clone()
    engine[1, 1] += 0.5
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = {k: float(v) for k, v in rollout_probs_diff(train, engine, mask).items()}
    assert out["rollout_probs_diff_max"] < 1e-5  # reads as agreement
    assert out["rollout_logprob_diff_max"] == pytest.approx(0.5, abs=1e-5)
    assert out["rollout_logprob_diff_mean"] == pytest.approx(0.5 / 5, abs=1e-5)  # over the 5 response tokens
    d = -0.5  # log(p_train / p_engine) on that token; k3 = r - 1 - log r, averaged over the tokens
    kl = mismatch_metrics(rollout_log_ratio(train, engine, mask), mask)["mismatch_kl"]  # rollout/mismatch_kl
    assert float(kl) == pytest.approx((math.exp(d) - 1 - d) / 5, rel=1e-4)
    assert "rollout_kl" not in out  # one KL of the gap, rollout/mismatch_kl, logged on every step
    same = rollout_probs_diff(train, train.clone(), mask)
    assert float(same["rollout_logprob_diff_max"]) == 0
    assert float(mismatch_metrics(rollout_log_ratio(train, train.clone(), mask), mask)["mismatch_kl"]) == 0
    assert rollout_probs_diff(train, engine, torch.zeros_like(mask)) == {}  # no response token: nothing to report
