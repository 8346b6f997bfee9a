"""Sequence parallelism (``RLHFModule(sequence_parallel=2)``, DeepSpeed-Ulysses) on 2 ranks over gloo, float32,
against data parallelism on the same global batch.

CI: ``tests/scripts/sequence_parallel_check.py`` under torchrun, a model with 1 key/value head (replicated to the
group) and activation checkpointing: the actor's log-probs and entropy, the critic's values, and the weight change of
one update of each equal the data-parallel run's, with no ``[T, T]`` mask built (rows are left-aligned, sdpa runs
causal); also without left padding, with the model's eager attention (which takes a mask), and with LoRA adapters
on the actor (peft; every ``lora_B`` non-zero): the adapters' update equals the data-parallel one, ``lora_A``
included, and the frozen base does not move. Long tier: two PPO
runs through the whole trainer (controller dispatch, reference, critic, actor), SP=2 with activation checkpointing
against SP=1: equal losses, gradient norms and weights at every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SCRIPTS, failure_text
from tests.distributed.test_activation_checkpointing_runs import COMPARED
from tests.distributed.test_activation_checkpointing_runs import _run as _ppo

TOLERANCE = 1e-5  # relative, float32


def test_sequence_parallel_equals_data_parallel_with_one_kv_head_and_checkpointing(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    args = [str(SCRIPTS / "sequence_parallel_check.py"), "--out", str(out), "--kv-heads", "1", "--checkpointing"]
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=dict(os.environ))
    assert proc.returncode == 0, failure_text(proc)
    report = json.loads(out.read_text())
    cases = {"actor": ("logprobs", "entropy"), "critic": ("values",), "actor-causal": ("logprobs",)}
    cases |= {"actor-lora": ("logprobs", "entropy")}
    for kind, outputs in (cases | {"actor-eager": ("logprobs",)}).items():
        got = report[kind]
        assert set(got["outputs"]) >= set(outputs), got
        assert all(got["outputs"][k] < TOLERANCE for k in outputs), (kind, got["outputs"])
        assert got["delta"] < TOLERANCE, (kind, got["delta"])
        assert got["delta_norm"] > 1e-3, got  # the update changed the weights: the comparison means something
        # the SP run went through the Ulysses attention (2 layers x forwards and recomputes); the DP run never
        assert got["ulysses_calls"]["sp"] > 0 and got["ulysses_calls"]["dp"] == 0, got["ulysses_calls"]
        # rows are left-aligned: sdpa runs causal with no [T, T] mask even for left-padded prompts; eager needs one
        assert (got["masks_built"] > 0) == (kind == "actor-eager"), (kind, got["masks_built"])
        for moved in got["moved"].values():  # every trained tensor changed (lora_A too), no frozen one
            assert all(n == total for key, (n, total) in moved.items() if key != "frozen"), (kind, moved)
            assert moved.get("frozen", [0])[0] == 0, (kind, moved)
        kinds = {"lora_A", "lora_B", "frozen"} if kind == "actor-lora" else {"trained"}
        assert set(got["moved"]["sp"]) == kinds, (kind, got["moved"])


@pytest.mark.long  # about 80 s; CI: the engine-level check above (same forwards, losses and FSDP reduction)
def test_ppo_with_sequence_parallel_equals_the_data_parallel_run(demo_model: str, tmp_path: Path) -> None:
    plain, plain_end = _ppo(demo_model, tmp_path / "dp")
    split, end = _ppo(demo_model, tmp_path / "sp", "--sequence-parallel", "2", "--activation-checkpointing")
    assert len(plain) == len(split) == 2
    for a, b in zip(plain, split, strict=True):
        for key in COMPARED:
            assert float(b[key]) == pytest.approx(float(a[key]), rel=TOLERANCE, abs=1e-7), (a["step"], key)
        # the rollout's log-probs (sampled on 2 data-parallel ranks) equal the SP actor's: the forward is exact
        assert float(b["training/rollout_probs_diff_max"]) < 1e-5
    assert end["param_checksum"] == pytest.approx(plain_end["param_checksum"], rel=1e-6)
    assert end["ulysses_calls"] > 0 and plain_end["ulysses_calls"] == 0, (end, plain_end)
