"""GPU checks (skipped without CUDA): FSDP2 training and transformers rollouts on the accelerator, bf16 compute."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import failure_text, run_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_trains_on_one_gpu_in_bf16(demo_model: str, tmp_path: Path, algo: str) -> None:
    args = ["--model", demo_model, "--out", str(tmp_path), "--accelerator", "gpu", "--devices", "1", "--bf16"]
    args += ["--algo", algo, "--steps", "3", "--kl-coef", "0.01"] + (["--n", "1"] if algo == "ppo" else [])
    proc = run_script("train.py", *args)
    assert proc.returncode == 0, failure_text(proc)
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3
    assert all(math.isfinite(float(r["actor/pg_loss"])) and math.isfinite(float(r["actor/grad_norm"])) for r in rows)
