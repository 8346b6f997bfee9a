"""The weight hand-off's check on a GPU (skipped without CUDA): FSDP2 trainer and transformers engine on the device
in bfloat16, every hand-off fingerprinted (``RolloutConfig.verify_every=1``). A good run passes the check at every
step and its engine/trainer log-probs agree; a run whose hand-off loses one tensor's data (``train.py --fault
handoff``: the tensor arrives as zeros) fails at that step naming the tensor. vLLM is not on the lent GPU machines,
so the transformers engine stands in for it here; the CPU suite covers vLLM's hand-off."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from tests.conftest import failure_text, run_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU = ["--accelerator", "gpu", "--devices", "1", "--bf16", "--rollout", "hf", "--steps", "4", "--n", "4"]


def test_every_hand_off_on_cuda_is_checked_and_the_log_probs_agree(demo_model: str, tmp_path: Path) -> None:
    proc = run_script("train.py", "--model", demo_model, "--out", str(tmp_path), *GPU)
    assert proc.returncode == 0, failure_text(proc)
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 4
    # each step after the first handed over the updated weights and checked them (the seconds of the check)
    assert all(float(r["perf/weight_verify_s"]) > 0 for r in rows[1:]), [r["perf/weight_verify_s"] for r in rows]
    # a wrong model differs by nats per token; bf16 rounding by far less
    diffs = [float(r["training/rollout_logprob_diff_mean"]) for r in rows]
    assert all(math.isfinite(d) and d < 0.1 for d in diffs), diffs


def test_a_hand_off_on_cuda_that_loses_a_tensor_fails_at_that_step(demo_model: str, tmp_path: Path) -> None:
    proc = run_script("train.py", "--model", demo_model, "--out", str(tmp_path), *GPU, "--fault", "handoff")
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "WeightSyncError" in text, failure_text(proc)
    assert "holds other values than the trainer in 'model.layers.0.mlp.down_proj.weight'" in text, failure_text(proc)
