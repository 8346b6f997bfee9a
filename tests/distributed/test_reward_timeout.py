"""A reward function that hangs on one rank, in a 2-rank run over gloo: the timeout ends it, training goes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import failure_text, run_script
from tests.distributed.test_training import read_metrics

pytestmark = pytest.mark.slow


def test_hanging_reward_times_out_and_training_continues(demo_model: str, tmp_path: Path) -> None:
    # 8 prompts x 4 samples over 2 ranks: each rank scores 16 samples per step in one call. Rank 1's call of
    # step 1 sleeps forever; with a 3 s timeout its 16 samples get the fallback score 0.0 and are counted.
    # A hang would end only at run_script's timeout (300 s); how fast the run goes is not this test's business.
    proc = run_script(
        "train.py",
        "--model",
        demo_model,
        "--out",
        str(tmp_path),
        "--devices",
        "2",
        "--steps",
        "3",
        "--reward",
        "hang",
        "--reward-timeout",
        "3",
    )
    assert proc.returncode == 0, failure_text(proc)
    rows = read_metrics(tmp_path)
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    failed = [float(r["reward/hanging_reward/failed"]) for r in rows]
    assert failed == [0.0, 16.0, 0.0]
    assert all(0.0 <= float(r["reward/hanging_reward/mean"]) <= 1.0 for r in rows)
    assert float(rows[1]["timing_s/step"]) >= 3.0  # waited for the 3 s timeout (the worker was then replaced)
    assert "reward function `hanging_reward` timed out after 3 s on 16 samples" in proc.stderr
    assert json.loads((tmp_path / "result.json").read_text())["global_step"] == 3
