"""Recipes run end to end with a tiny local model and a small local dataset substituted."""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, failure_text

pytestmark = pytest.mark.slow


def load_recipe(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "recipes" / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gsm8k_reward_reads_the_final_number() -> None:
    reward = load_recipe("grpo_gsm8k").gsm8k_reward
    ref = ["Natalia sold 48/2 = 24 clips in May. 48+24 = 72\n#### 72"] * 4
    got = reward(["q"] * 4, ["so #### 72", "#### 1,072", "no answer", "#### 7 then #### 72."], answer=ref)
    assert got == [1.0, 0.1, 0.0, 1.0]


def test_grpo_gsm8k_recipe_runs_a_step(demo_model: str, tmp_path: Path) -> None:
    data = tmp_path / "gsm8k.jsonl"
    rows = [{"question": f"{a}+{b}=", "answer": f"#### {a + b}"} for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    args = ["--model", demo_model, "--data", str(data), "--accelerator", "cpu", "--devices", "1", "--steps", "2"]
    args += ["--prompts", "4", "--n", "2", "--max-new-tokens", "6", "--micro-batch-size", "4", "--out", str(tmp_path)]
    args += ["--max-prompt-length", "32"]  # the tiny model has 64 positions
    proc = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "grpo_gsm8k.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, failure_text(proc)
    (metrics,) = tmp_path.rglob("metrics.csv")
    with open(metrics) as f:
        steps = [r for r in csv.DictReader(f) if r.get("critic/score/mean")]
    assert len(steps) == 2 and all(0.0 <= float(r["critic/score/mean"]) <= 1.0 for r in steps)
