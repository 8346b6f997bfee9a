"""Each ready algorithm learns the synthetic task (2 processes): last 10% of steps >= first 10% + 0.2. PPO also
learns with a split placement (actor on rank 0, critic on rank 1), GRPO with asynchronous rollouts (generation on
rank 1, one step ahead).

GRPO is covered by the demo test (250 steps, +0.3, vLLM rollouts when installed); these run 120 steps each.
ReMax (with its extra greedy generate call) uses the vLLM engine when installed, the others the transformers
engine: both engines have learning tests, and the suite stays short (each vLLM start costs ~20 s here).
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_rlhf.callbacks.history import first_last
from tests.conftest import ROOT, demo_rows

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("algo", "placement"),
    [
        ("rloo", "colocate"),
        ("reinforce_pp", "colocate"),
        ("remax", "colocate"),
        ("ppo", "colocate"),
        ("ppo", "split"),
        ("grpo", "async"),
    ],
)
def test_algorithm_learns_addition(algo: str, placement: str, demo_model: str, tmp_path: Path) -> None:
    """``split``: the actor and the reward on rank 0, the critic on rank 1, their updates at the same time.
    ``async``: generation alone on rank 1, one step ahead of the actor's updates on rank 0 (``max_staleness=1``)."""
    cache = str(Path(demo_model).parent)  # reuse the session's warm-started model
    where = ["--placement", "rollout", "--max-staleness", "1"] if placement == "async" else ["--placement", placement]
    cmd = [sys.executable, "-m", "lightning_rlhf.demo", "--algo", algo, "--steps", "120", *where]
    cmd += ["--out", str(tmp_path), "--cache", cache, "--rollout", "auto" if algo == "remax" else "hf"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    rows = demo_rows(proc)
    scores = [float(r["critic/score/mean"]) for r in rows]
    assert len(scores) == (119 if placement == "async" else 120)  # the first asynchronous step only generates
    first, last = first_last(scores)
    assert last >= first + 0.2, (algo, first, last)
    if algo == "ppo":
        assert all(0 < float(r["critic/vf_loss"]) < math.inf for r in rows)  # a squared error, never exact
    if placement == "split":  # the two updates overlap: the stage is shorter than their sum on most steps
        overlapped = [
            float(r["timing_s/stage_update"]) < float(r["timing_s/update_actor"]) + float(r["timing_s/update_critic"])
            for r in rows
        ]
        assert sum(overlapped) > 0.8 * len(rows)
    if placement == "async":  # trained one update after the weights that sampled them, with IS weights
        assert all(float(r["training/staleness_max"]) <= 1 for r in rows)
        assert sum(float(r["training/staleness_max"]) == 1 for r in rows) >= len(rows) - 1
        assert all(0 < float(r["actor/rollout_is_mean"]) <= 2.0 for r in rows)
    if algo == "remax":
        assert "critic/baseline_score/mean" in rows[0]


@pytest.mark.parametrize(
    ("loss", "advantage"),
    [("cispo", "grpo"), ("sapo", "grpo"), ("gpg", "gpg"), ("dppo_kl", "grpo"), ("dppo_tv", "grpo")],
)
def test_policy_loss_learns_addition(loss: str, advantage: str, demo_model: str, tmp_path: Path) -> None:
    """The 2026 policy losses on GRPO's dataflow, 150 steps, four optimizer steps per batch (``--mini-batch-size
    64`` of 256 samples), so that the later ones are off-policy and the loss's clip, gate or mask acts: each gains at
    least 0.3."""
    cache = str(Path(demo_model).parent)
    cmd = [sys.executable, "-m", "lightning_rlhf.demo", "--policy-loss", loss, "--advantage", advantage]
    cmd += ["--mini-batch-size", "64", "--steps", "150", "--out", str(tmp_path), "--cache", cache, "--rollout", "hf"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    rows = demo_rows(proc)
    first, last = first_last([float(r["critic/score/mean"]) for r in rows])
    assert last >= first + 0.3, (loss, first, last)
    if loss != "gpg":  # the clip, gate or mask acted on some token (GPG has none)
        assert any(float(r["actor/pg_clipfrac"]) > 0 for r in rows), loss
