"""Activation checkpointing under FSDP2 on 2 ranks (``RLHFModule(activation_checkpointing=True)``): PPO, so the
actor and the critic are both checkpointed, gives the same gradient norms, losses and weights at every step as the
run without it (fp32). The shared-prefix forward is on (the default) with groups of 4 samples."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from tests.conftest import failure_text, run_script

COMPARED = ("actor/grad_norm", "actor/pg_loss", "critic/grad_norm", "critic/vf_loss")


def _run(model: str, out: Path, *extra: str) -> tuple[list[dict[str, str]], dict[str, float]]:
    args = ["--model", model, "--out", str(out), "--algo", "ppo", "--steps", "2", "--n", "4", "--kl-coef", "0.01"]
    proc = run_script("train.py", *args, *extra)
    assert proc.returncode == 0, failure_text(proc)
    with open(out / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("actor/grad_norm")]
    return rows, json.loads((out / "result.json").read_text())


def test_checkpointed_ppo_equals_the_plain_run(demo_model: str, tmp_path: Path) -> None:
    plain, plain_end = _run(demo_model, tmp_path / "plain")
    checkpointed, end = _run(demo_model, tmp_path / "checkpointed", "--activation-checkpointing", "--memory-census")
    assert len(plain) == len(checkpointed) == 2
    for a, b in zip(plain, checkpointed, strict=True):
        for key in COMPARED:
            assert float(b[key]) == pytest.approx(float(a[key]), rel=1e-5, abs=1e-7), (a["step"], key)
    assert all(float(r["actor/grad_norm"]) > 0 and float(r["critic/grad_norm"]) > 0 for r in plain)
    assert end["param_checksum"] == pytest.approx(plain_end["param_checksum"], rel=1e-6)
    # the comparison means something: the checkpointed run's actor and critic blocks did recompute
    assert end["checkpointed_blocks"]["actor"] > 0 and end["checkpointed_blocks"]["critic"] > 0, end
    assert not any(plain_end["checkpointed_blocks"].values()), plain_end
    # the memory figures of a run: each rank holds half of each model's float32 parameters (FSDP2 over 2 ranks; the
    # root's, which FSDP keeps gathered after a forward, whole), its trained roles' AdamW state twice the half; each
    # role call's peak is the process's peak within it
    full_gb = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(demo_model).parameters()) * 4 / 2**30
    for row in checkpointed:
        for role in ("actor", "reference"):
            assert full_gb / 2 * 0.99 < float(row[f"perf/memory_held_gb/{role}/params"]) < full_gb * 0.75, role
        assert float(row["perf/memory_held_gb/actor/optimizer"]) == pytest.approx(full_gb, rel=0.02)
        assert float(row["perf/memory_held_gb/critic/optimizer"]) > 0
        for call in ("actor.update", "critic.update", "reference.log_prob"):
            peak, added = float(row[f"perf/memory_peak_gb/{call}"]), float(row[f"perf/memory_added_gb/{call}"])
            assert 0 <= added < peak <= float(row["perf/cpu_memory_peak_gb"]) * 1.001, (call, peak, added)
    assert not any(key.startswith("perf/memory_held_gb") for key in plain[0]), "the census is off by default"
