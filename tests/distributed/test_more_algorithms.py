"""Dataflows with more than GRPO's steps, over 2 ranks: DAPO's dynamic sampling and Safe-RLHF's cost role."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from tests.conftest import failure_text, run_script

pytestmark = pytest.mark.slow


def _rows(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def test_dapo_resamples_until_groups_disagree(demo_model: str, tmp_path: Path) -> None:
    proc = run_script("train.py", "--model", demo_model, "--out", str(tmp_path), "--algo", "dapo", "--steps", "3")
    assert proc.returncode == 0, failure_text(proc)
    rows = _rows(tmp_path)
    assert len(rows) == 3
    dropped = [float(r["dynamic_sampling/dropped_groups"]) for r in rows]
    rounds = [float(r["dynamic_sampling/rounds"]) for r in rows]
    filled = [float(r["dynamic_sampling/filled_groups"]) for r in rows]
    assert sum(dropped) > 0  # the warm-started model answers some prompts always right (or always wrong)
    for d, k, f in zip(dropped, rounds, filled, strict=True):
        assert k == (1 if d == 0 else 2)  # another round exactly when the first dropped groups (cap: 2 rounds)
        assert 0 <= f <= d
    assert all(math.isfinite(float(r["actor/pg_loss"])) for r in rows)


def test_safe_rlhf_trains_two_critics_and_raises_the_multiplier_over_the_limit(demo_model: str, tmp_path: Path) -> None:
    proc = run_script("train.py", "--model", demo_model, "--out", str(tmp_path), "--algo", "safe", "--steps", "3")
    assert proc.returncode == 0, failure_text(proc)
    rows = _rows(tmp_path)
    assert len(rows) == 3
    for r in rows:
        for name in ("critic/vf_loss", "cost_critic/vf_loss", "safety/cost/mean", "actor/pg_loss"):
            assert math.isfinite(float(r[name])), name
    lambdas = [float(r["safety/lambda"]) for r in rows]
    costs = [float(r["safety/cost/mean"]) for r in rows]
    assert max(costs) > 0  # some responses wrote a 7
    # cost_limit=0: the multiplier grows on every step whose responses wrote a 7, and never shrinks
    for before, now, cost in zip([1.0, *lambdas], lambdas, costs, strict=False):
        assert now > before if cost > 0 else now == pytest.approx(before)


def test_distillation_scores_the_students_tokens_with_a_teacher_on_a_pool_of_its_own(
    demo_model: str, tiny_model: str, tmp_path: Path
) -> None:
    """On-policy distillation, the student (the demo's warm start) on rank 0 with the reward, the teacher (a random
    model of the same vocabulary) alone on rank 1: every step logs the reverse KL to the teacher and trains the
    actor on it."""
    placement = '{"actor": [0], "reward": [0], "teacher": [1]}'
    args = ["--model", demo_model, "--out", str(tmp_path), "--algo", "distill", "--teacher", tiny_model]
    proc = run_script("train.py", *args, "--devices", "2", "--placement", placement, "--steps", "3")
    assert proc.returncode == 0, failure_text(proc)
    rows = _rows(tmp_path)
    assert len(rows) == 3
    for r in rows:  # a random teacher disagrees with the warm-started student on nearly every token
        assert float(r["distill/reverse_kl"]) > 1.0
        assert math.isfinite(float(r["actor/pg_loss"])) and float(r["actor/grad_norm"]) > 0
        assert float(r["timing_s/teacher"]) > 0  # the teacher's call ran (on its pool)
