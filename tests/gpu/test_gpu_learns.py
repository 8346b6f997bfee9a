"""The demo learns on a GPU the way a user of the transformers engine runs it (skipped without CUDA): transformers'
``generate``, bfloat16 compute, PyTorch's own ops (``--cpu-layer off``), one GPU. 100 steps of 32 prompts x 8
samples; the last 10% of steps score at least 0.3 above the first 10% (the demo's bound)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_rlhf.callbacks.history import first_last
from tests.conftest import ROOT, demo_rows

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 100


def test_demo_learns_with_generate_in_bf16_on_a_gpu(demo_model: str, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "lightning_rlhf.demo", "--accelerator", "gpu", "--devices", "1"]
    cmd += ["--rollout", "hf", "--decode", "generate", "--cpu-layer", "off", "--precision", "bf16"]
    cmd += ["--steps", str(STEPS), "--out", str(tmp_path / "runs"), "--cache", str(Path(demo_model).parent)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=str(ROOT))
    rows = demo_rows(proc)
    scores = [float(r["critic/score/mean"]) for r in rows]
    assert len(scores) == STEPS
    first, last = first_last(scores)
    assert last >= first + 0.3, (first, last)
    assert all(math.isfinite(float(r["training/rollout_logprob_diff_max"])) for r in rows)
