"""GRPO and PPO still learn with the CPU speed layer off (``LIGHTNING_RLHF_CPU_KERNELS=0``: PyTorch's own ops
everywhere, as on a GPU), 2 processes, the transformers engine: last 10% of steps >= first 10% + 0.2.

The other learning tests run with the layer on (the default on CPU); this one checks that nothing outside
``lightning_rlhf/cpu`` depends on it. The run's kernel cache stays empty: no process built the compiled kernels.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, failure_text

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_algorithm_learns_with_the_cpu_layer_off(algo: str, demo_model: str, tmp_path: Path) -> None:
    cache = str(Path(demo_model).parent)  # the session's warm-started model
    kernels = tmp_path / "cache"  # where a process that compiled the CPU kernels would leave them
    env = {**os.environ, "LIGHTNING_RLHF_CPU_KERNELS": "0", "LIGHTNING_RLHF_CACHE": str(kernels)}
    cmd = [sys.executable, "-m", "lightning_rlhf.demo", "--algo", algo, "--steps", "120", "--rollout", "hf"]
    cmd += ["--out", str(tmp_path / "runs"), "--cache", cache]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=str(ROOT), env=env)
    assert proc.returncode == 0, failure_text(proc)
    run = Path(proc.stdout.strip().splitlines()[-1].removeprefix("run folder: "))
    with open(run / "metrics.csv") as f:
        scores = [float(r["critic/score/mean"]) for r in csv.DictReader(f) if r.get("critic/score/mean")]
    assert len(scores) == 120
    k = len(scores) // 10
    first, last = sum(scores[:k]) / k, sum(scores[-k:]) / k
    assert last >= first + 0.2, (algo, first, last)
    assert not (kernels / "kernels").exists(), "a process compiled the CPU kernels with the layer off"
