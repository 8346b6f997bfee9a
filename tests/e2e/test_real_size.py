"""A real model size end to end on this machine (``recipes/real_size_cpu.yaml``): Qwen2.5-0.5B's configuration with
random weights, GRPO with a reference, vLLM at tensor parallel 2 colocated, responses of 512 tokens, 2 processes:
3 steps and a checkpoint, a resume for a 4th step, an export. The resident memory of each rank is sampled from
outside the processes (``benchmarks/rss_sampler.py``) and set against ``lightning-rlhf plan``'s prediction for the
recipe. Long tier: about half an hour here, and about 10 GiB a process."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import ROOT, failure_text, run_cli

RECIPE = "recipes/real_size_cpu.yaml"


def _sampled(out: Path, *args: str) -> dict[str, object]:
    """Run ``lightning-rlhf fit`` under the sampler; its ``rss.json``."""
    cli = Path(sys.executable).with_name("lightning-rlhf")
    sampler = [sys.executable, str(ROOT / "benchmarks" / "rss_sampler.py"), "--out", str(out), "--"]
    proc = subprocess.run(
        [*sampler, str(cli), "fit", "--config", RECIPE, *args],
        capture_output=True, text=True, timeout=3600, cwd=str(ROOT),
        env={**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"},
    )  # fmt: skip
    assert proc.returncode == 0, failure_text(proc)
    return json.loads((out / "rss.json").read_text())


def test_a_half_billion_parameter_model_trains_resumes_and_exports(tmp_path: Path) -> None:
    save = ["--trainer.logger.save_dir", str(tmp_path)]
    run = tmp_path / "real_size_cpu"
    first = _sampled(tmp_path / "rss_fit", *save)
    last = run / "checkpoints" / "last.ckpt"
    assert last.exists()  # a folder: the sharded checkpoint
    resumed = _sampled(tmp_path / "rss_resume", *save, "--trainer.max_steps", "4", "--ckpt_path", str(last))
    with open(run / "metrics.csv") as f:
        steps = [r for r in csv.DictReader(f) if r.get("actor/grad_norm")]
    assert [int(r["step"]) for r in steps][-1] >= 3 and len(steps) >= 4, [r["step"] for r in steps]
    for row in steps:  # every phase measured: the memory each call took on top of what the rank held
        for call in ("actor.generate", "actor.update", "reference.log_prob"):
            assert float(row[f"perf/memory_peak_gb/{call}"]) > float(row[f"perf/memory_added_gb/{call}"]) >= 0
        assert float(row["perf/memory_held_gb/actor/optimizer"]) > 1.5  # AdamW's two states of a 0.25B shard

    exported = tmp_path / "exported"
    proc = run_cli("export", str(last), str(exported), timeout=900)
    assert proc.returncode == 0, failure_text(proc)
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 494_032_768  # Qwen2.5-0.5B, the tied embedding once

    # the planner's peak per device for this recipe against the sampled peaks of the run (within 25%). The resumed
    # process's first update peaks ~1.1 GiB higher (a first update in a process does, fit step 0 too; docs/sizing.md):
    # printed with the figures, not held to the plan, which models the steady step.
    plan = run_cli("plan", "--config", RECIPE, "--devices", "2", "--device-type", "cpu", "--tp-sizes", "2", timeout=900)
    assert plan.returncode == 0, failure_text(plan)
    predicted = float(re.search(r"peak ([\d.]+) GB per device", plan.stdout)[1])  # type: ignore[index]
    sampled = max(float(gib) * 2**30 / 1e9 for name, gib in first["peaks_gb"].items() if name.startswith("rank"))
    print(f"plan {predicted} GB; sampled fit {sampled:.2f} GB, resumed {resumed['peaks_gb']} GiB")  # GiB -> GB above
    assert sampled == pytest.approx(predicted, rel=0.25), (sampled, predicted, first["phases"])
