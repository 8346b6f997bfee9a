"""The embedded jobs learn: the default one (addition), mean reward of the last 10% of steps >= first 10% + 0.3,
and the tool task (2 processes each)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, failure_text

pytestmark = pytest.mark.slow


def test_demo_job_learns_addition(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_rlhf.demo",
            "--out",
            str(tmp_path / "runs"),
            "--cache",
            str(tmp_path / "cache"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, failure_text(proc)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("run folder: ")
    run = Path(last.removeprefix("run folder: "))
    assert (run / "reward.png").stat().st_size > 1000
    with open(run / "metrics.csv") as f:
        scores = [float(r["critic/score/mean"]) for r in csv.DictReader(f) if r.get("critic/score/mean")]
    assert len(scores) == 250
    k = len(scores) // 10
    first, last10 = sum(scores[:k]) / k, sum(scores[-k:]) / k
    assert last10 >= first + 0.3, (first, last10)


def test_tool_demo_learns_to_use_the_calculator(tmp_path: Path) -> None:
    """``--task tools``: GRPO with the calculator raises the training reward by 0.1 and the held-out success of
    greedy episodes to 0.95 or more (0.906 after the warm start, measured 1.0); the same model without the tool
    gets (almost) none of the three-digit sums right, before or after RL."""
    command = [sys.executable, "-m", "lightning_rlhf.demo", "--task", "tools"]
    proc = subprocess.run(
        [*command, "--out", str(tmp_path / "runs"), "--cache", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, failure_text(proc)
    run = Path(proc.stdout.strip().splitlines()[-1].removeprefix("run folder: "))
    with open(run / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    scores = [float(r["critic/score/mean"]) for r in rows if r.get("critic/score/mean")]
    assert len(scores) == 60
    k = len(scores) // 10
    assert sum(scores[-k:]) / k >= sum(scores[:k]) / k + 0.1, scores
    turns = [float(r["rollout/turns/mean"]) for r in rows if r.get("rollout/turns/mean")]
    assert min(turns) > 1.5  # nearly every episode: a call, its result, an answer
    table = json.loads((run / "tool_success.json").read_text())
    assert table["after RL, with the tool"]["success"] >= max(0.95, table["before RL, with the tool"]["success"])
    assert table["after RL, with the tool"]["tool_calls"] >= 0.9
    assert table["before RL, without the tool"]["success"] <= 0.1
    assert table["after RL, without the tool"]["success"] <= 0.1
    assert "held-out success" in proc.stdout


def _demo(tmp_path: Path, *args: str, timeout: int = 900) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    """A demo run with ``args``: the process and its metrics rows."""
    command = [sys.executable, "-m", "lightning_rlhf.demo", *args]
    proc = subprocess.run(
        [*command, "--out", str(tmp_path / "runs"), "--cache", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(ROOT),
    )
    assert proc.returncode == 0, failure_text(proc)
    run = Path(proc.stdout.strip().splitlines()[-1].removeprefix("run folder: "))
    with open(run / "metrics.csv") as f:
        return proc, list(csv.DictReader(f))


def test_demo_learns_with_partial_rollouts(tmp_path: Path) -> None:
    """``--placement rollout --max-staleness 2 --partial-rollouts``: the rollout pool streams, hand-offs interrupt it,
    and the demo still learns (the training reward's gain >= 0.3, the held-out score's >= 0.2: the thresholds of the
    colocated run's)."""
    _, rows = _demo(tmp_path, "--placement", "rollout", "--max-staleness", "2", "--partial-rollouts")
    scores = [float(r["critic/score/mean"]) for r in rows if r.get("critic/score/mean")]
    k = len(scores) // 10
    assert sum(scores[-k:]) / k >= sum(scores[:k]) / k + 0.3, scores
    val = [float(r["val/score/mean"]) for r in rows if r.get("val/score/mean")]
    assert val[-1] >= val[0] + 0.2, val
    assert all(float(r["training/staleness_max"]) <= 2 for r in rows if r.get("training/staleness_max"))


def test_tool_demo_learns_with_an_agent_over_http(tmp_path: Path) -> None:
    """``--task tools --agent http``: an agent written against the openai client drives every episode through the
    endpoint; the training reward rises by 0.1 and every step's episodes call the calculator over several turns."""
    proc, rows = _demo(tmp_path, "--task", "tools", "--agent", "http", timeout=1500)
    scores = [float(r["critic/score/mean"]) for r in rows if r.get("critic/score/mean")]
    assert len(scores) == 60
    k = len(scores) // 10
    assert sum(scores[-k:]) / k >= sum(scores[:k]) / k + 0.1, scores
    assert min(float(r["rollout/turns/mean"]) for r in rows if r.get("rollout/turns/mean")) > 1.5
    assert "held-out success" in proc.stdout


def test_demo_learns_by_distillation(tmp_path: Path) -> None:
    """``--algo distill --steps 100``: the demo's GRPO-trained model (built once, in a child run) taught to a fresh
    copy of the warm start: the reverse KL to the teacher falls to a quarter, the training reward gains 0.3, and the
    student's held-out success ends within 0.1 of the teacher's."""
    proc, rows = _demo(tmp_path, "--algo", "distill", "--steps", "100", "--rollout", "hf", timeout=1500)
    steps = [r for r in rows if r.get("critic/score/mean")]
    scores = [float(r["critic/score/mean"]) for r in steps]
    kl = [float(r["distill/reverse_kl"]) for r in steps]
    k = len(steps) // 10
    assert sum(scores[-k:]) / k >= sum(scores[:k]) / k + 0.3, scores
    assert sum(kl[-k:]) / k <= sum(kl[:k]) / k / 4, kl
    run = Path(proc.stdout.strip().splitlines()[-1].removeprefix("run folder: "))
    table = json.loads((run / "distillation.json").read_text())
    assert table["student after"] >= table["teacher"] - 0.1, table
    assert table["teacher"] > table["student before"], table  # the teacher knows more than the warm start


def test_distillation_teaches_a_student_that_grpo_cannot_move(tmp_path: Path) -> None:
    """The tool task from a 100-step warm start (held-out success 0.0: no sampled episode scores, so every GRPO
    advantage is 0): distilled for 60 steps (lr 1e-3) from the tool demo's GRPO-trained model (held-out 1.0), the
    student's held-out success ends within 0.1 of the teacher's (measured 0.97 at step 60, 0.91 at step 40); GRPO from
    the same start with the same settings stays at 0 (measured 0.0 at every validation of 200 steps)."""
    common = ["--task", "tools", "--warm-start-steps", "100", "--lr", "1e-3", "--steps", "60", "--val-every", "20"]
    proc, _ = _demo(tmp_path, "--algo", "distill", *common, timeout=2400)
    run = Path(proc.stdout.strip().splitlines()[-1].removeprefix("run folder: "))
    table = json.loads((run / "tool_success.json").read_text())
    teacher = table["teacher, with the tool"]["success"]
    assert table["before RL, with the tool"]["success"] <= 0.1 < teacher, table
    assert table["after RL, with the tool"]["success"] >= teacher - 0.1, table
    _, rows = _demo(tmp_path, *common, timeout=1500)  # GRPO, the same start (the cache is shared)
    held_out = [float(r["val/score/mean"]) for r in rows if r.get("val/score/mean")]
    assert len(held_out) == 4 and max(held_out) <= 0.1, held_out


def test_vision_demo_learns_to_count(tmp_path: Path) -> None:
    """``--task vision``: a tiny Qwen2-VL, warm-started on the answer format without the images, learns by GRPO (its
    vision tower frozen, vLLM sampling with the images) to count the squares of images it has not seen: the held-out
    success of greedy answers goes from chance (4 answers) to 0.8 or more (measured 1.0), the training reward (sampled
    at temperature 1) gains 0.15 or more (measured 0.24 -> 0.53 with transformers' engine)."""
    _, rows = _demo(tmp_path, "--task", "vision", timeout=1200)
    scores = [float(r["critic/score/mean"]) for r in rows if r.get("critic/score/mean")]
    held_out = [float(r["val/score/mean"]) for r in rows if r.get("val/score/mean")]
    k = len(scores) // 10
    assert sum(scores[-k:]) / k >= sum(scores[:k]) / k + 0.15, scores
    assert held_out[0] <= 0.4 and held_out[-1] >= 0.8, held_out
