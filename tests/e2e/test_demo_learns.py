"""The embedded default job learns: mean reward of the last 10% of steps >= first 10% + 0.3 (2 processes)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, failure_text

pytestmark = pytest.mark.slow


def test_demo_job_learns_addition(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_rlhf.demo",
            "--out",
            str(tmp_path / "runs"),
            "--cache",
            str(tmp_path / "cache"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, failure_text(proc)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("run folder: ")
    run = Path(last.removeprefix("run folder: "))
    assert (run / "reward.png").stat().st_size > 1000
    with open(run / "metrics.csv") as f:
        scores = [float(r["critic/score/mean"]) for r in csv.DictReader(f) if r.get("critic/score/mean")]
    assert len(scores) == 250
    k = len(scores) // 10
    first, last10 = sum(scores[:k]) / k, sum(scores[-k:]) / k
    assert last10 >= first + 0.3, (first, last10)
