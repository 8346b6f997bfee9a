"""docs/your-own-task.md end to end, at tiny sizes: build the "which is larger?" data, warm-start the untrained
embedded model with ``lightning-rlhf sft``, then ``lightning-rlhf fit`` GRPO from the fine-tuned model, run from
the task's folder as the page says; the SFT loss falls, RL validates before and after, and its export loads."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import ROOT, failure_text

pytestmark = pytest.mark.slow

TASK = ROOT / "recipes" / "larger"


def lightning_rlhf(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The console script, run from ``folder`` (where the recipes' relative paths and the reward module are)."""
    script = Path(sys.executable).with_name("lightning-rlhf")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(script), *args], capture_output=True, text=True, timeout=300, cwd=folder, env=env)


def rows(csv_path: Path, key: str) -> list[dict[str, str]]:
    with open(csv_path) as f:
        return [r for r in csv.DictReader(f) if r.get(key)]


def test_sft_then_grpo_on_your_own_task(tmp_path: Path) -> None:
    for name in ("larger_task.py", "sft.yaml", "grpo.yaml"):
        shutil.copy(TASK / name, tmp_path / name)
    data = subprocess.run(
        [sys.executable, "larger_task.py", "--train", "128", "--heldout", "16"], cwd=tmp_path, capture_output=True
    )
    assert data.returncode == 0, data.stderr
    assert len((tmp_path / "train.jsonl").read_text().splitlines()) == 128

    sft = lightning_rlhf(
        tmp_path, "sft", "--config", "sft.yaml",
        "--trainer.max_steps", "12", "--trainer.val_check_interval", "12", "--data.batch_size", "32",
    )  # fmt: skip
    assert sft.returncode == 0, failure_text(sft)
    losses = [float(r["sft/loss"]) for r in rows(tmp_path / "runs" / "sft" / "metrics.csv", "sft/loss")]
    assert len(losses) == 12 and losses[-1] < losses[0] - 1.0
    val = [float(r["val/loss"]) for r in rows(tmp_path / "runs" / "sft" / "metrics.csv", "val/loss")]
    assert len(val) == 2 and val[1] < val[0]  # before the first step and after the last
    assert "loss (sft/loss)" in sft.stdout  # the run summary

    rl = lightning_rlhf(
        tmp_path, "fit", "--config", "grpo.yaml",
        "--trainer.devices", "1", "--trainer.strategy.rollout", "hf", "--trainer.max_steps", "3",
        "--trainer.val_check_interval", "3", "--data.batch_size", "8", "--model.rollout.n", "4",
    )  # fmt: skip
    assert rl.returncode == 0, failure_text(rl)
    metrics = tmp_path / "runs" / "grpo" / "metrics.csv"
    assert len(rows(metrics, "critic/score/mean")) == 3
    assert [int(r["step"]) for r in rows(metrics, "val/score/mean")] == [0, 3]
    assert "validation (val/score/mean)" in rl.stdout
    exported = tmp_path / "runs" / "grpo" / "actor"
    model = AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    ids = tokenizer("Which is larger, 41 or 19? Answer:", return_tensors="pt")
    assert model.generate(**ids, max_new_tokens=3, do_sample=False).shape[1] > ids["input_ids"].shape[1]
