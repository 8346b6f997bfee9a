"""Multi-process training runs (2 ranks over gloo), launched as subprocesses.

Each test runs ``tests/scripts/train.py``; Lightning's launcher starts rank 1 from it, as it would for a user.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from tests.conftest import failure_text, run_script

pytestmark = pytest.mark.slow

REQUIRED_METRICS = [
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "critic/score/mean",
    "critic/advantages/mean",
    "response_length/mean",
    "timing_s/gen",
    "timing_s/update_actor",
    "timing_s/step",
    "perf/throughput",
    "perf/mfu/actor",
    "perf/cpu_memory_used_gb",
    "timing_per_token_ms/update_actor",
]


def read_metrics(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def check_ok(proc) -> None:
    assert proc.returncode == 0, failure_text(proc)


def test_grpo_two_ranks_logs_every_metric_and_counts_rl_steps(demo_model: str, tmp_path: Path) -> None:
    # mini-batches and micro-batches: 8 prompts x 4 samples = 32 samples, 2 optimizer steps per epoch, 2 epochs.
    # The same run logs to wandb (offline) and has a ModelCheckpoint monitor the controller's reward.
    proc = run_script(
        "train.py",
        "--model",
        demo_model,
        "--out",
        str(tmp_path),
        "--devices",
        "2",
        "--steps",
        "3",
        "--mini-batch-size",
        "16",
        "--micro-batch-size",
        "4",
        "--ppo-epochs",
        "2",
        "--kl-coef",
        "0.01",
        "--wandb",
        "--checkpoint-callback",
    )
    check_ok(proc)
    rows = read_metrics(tmp_path)
    assert [int(r["step"]) for r in rows] == [
        0,
        1,
        2,
    ]  # global_step counts RL iterations, not the 4 optimizer steps
    for name in [*REQUIRED_METRICS, "actor/kl_loss"]:
        values = [float(r[name]) for r in rows]
        assert all(math.isfinite(v) for v in values), name
    assert all(float(r["response_length/mean"]) > 0 for r in rows)
    assert 0.0 <= float(rows[0]["critic/score/mean"]) <= 1.0
    # A second epoch over the same rollouts moves the policy away from the rollout policy.
    assert max(float(r["actor/ppo_kl"]) for r in rows) != 0.0
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["global_step"] == 3
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and any(f.suffix == ".wandb" for f in runs[0].iterdir())
    # ModelCheckpoint monitors the controller's reward on every rank (the logs are replayed on workers).
    assert list((tmp_path / "ckpt").iterdir()), "ModelCheckpoint saved nothing"


def test_ppo_with_critic_and_reference_two_ranks(demo_model: str, tmp_path: Path) -> None:
    # With a token budget: every role's forwards go in packed, trimmed micro-batches, its rows balanced over the
    # ranks by tokens (the actor, critic and reference DP_SPLIT calls, each merged back in the caller's order).
    proc = run_script(
        "train.py",
        "--model",
        demo_model,
        "--out",
        str(tmp_path),
        "--algo",
        "ppo",
        "--devices",
        "2",
        "--steps",
        "2",
        "--n",
        "1",
        "--prompts",
        "8",
        "--kl-coef",
        "0.05",
        "--micro-batch-tokens",
        "24",
    )
    check_ok(proc)
    rows = read_metrics(tmp_path)
    assert len(rows) == 2
    for name in [
        *REQUIRED_METRICS,
        "critic/vf_loss",
        "critic/grad_norm",
        "critic/values/mean",
        "timing_s/update_critic",
    ]:
        assert all(math.isfinite(float(r[name])) for r in rows), name
    assert float(rows[0]["critic/vf_loss"]) > 0


def test_resume_continues_like_the_uninterrupted_run(demo_model: str, tmp_path: Path) -> None:
    straight, first, second = tmp_path / "straight", tmp_path / "first", tmp_path / "second"
    ckpt = tmp_path / "ckpt"
    common = ["--model", demo_model, "--devices", "2", "--prompts", "8", "--n", "4"]
    check_ok(run_script("train.py", *common, "--out", str(straight), "--steps", "4"))
    check_ok(run_script("train.py", *common, "--out", str(first), "--steps", "2", "--save-ckpt", str(ckpt)))
    assert (ckpt / "meta.pt").exists() or any(ckpt.iterdir())  # a sharded (folder) checkpoint
    check_ok(run_script("train.py", *common, "--out", str(second), "--steps", "4", "--resume", str(ckpt)))
    full, resumed = read_metrics(straight), read_metrics(second)
    assert [int(r["step"]) for r in resumed] == [2, 3]
    for a, b in zip(full[2:], resumed, strict=True):
        for key in (
            "critic/score/mean",
            "actor/pg_loss",
            "actor/grad_norm",
            "response_length/mean",
            "actor/lr",
        ):
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-6), key
    end_full = json.loads((straight / "result.json").read_text())["param_checksum"]
    end_resumed = json.loads((second / "result.json").read_text())["param_checksum"]
    assert end_full == pytest.approx(end_resumed, rel=1e-6)


def test_reward_error_on_a_worker_reaches_the_controller(demo_model: str, tmp_path: Path) -> None:
    proc = run_script("train.py", "--model", demo_model, "--out", str(tmp_path), "--devices", "2", "--fault", "reward")
    assert proc.returncode != 0
    assert "WorkerError: rank 1 failed in `reward.score`" in proc.stderr
    assert "reward exploded on purpose" in proc.stderr
    assert "failing_reward" in proc.stderr  # the worker's own traceback frames


def test_worker_dying_mid_collective_does_not_hang(demo_model: str, tmp_path: Path) -> None:
    # Rank 1 raises in actor.update while rank 0 waits in an FSDP all-gather that rank 1 never joins. Without the
    # 5 s error timeout rank 0 would wait out the 30 min process-group timeout; run_script's 300 s limit fails it.
    proc = run_script(
        "train.py",
        "--model",
        demo_model,
        "--out",
        str(tmp_path),
        "--devices",
        "2",
        "--fault",
        "actor_update",
        "--error-timeout",
        "5",
    )
    assert proc.returncode != 0
    assert "rank 1 failed in `actor.update`" in proc.stderr
    assert "actor update exploded on purpose" in proc.stderr
