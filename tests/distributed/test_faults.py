"""Faults on 2-rank runs (subprocesses, hard timeouts): a rank killed mid-step is named on the survivor, every rank
exits non-zero and none is left over; a preemption signal on any rank saves a checkpoint at the step boundary and
exits with 128 + signum, and resuming from it logs what the uninterrupted run logs; a save killed half-way leaves
nothing that resume accepts, and a bad ``ckpt_path`` is refused before any model loads.

Each test runs ``tests/scripts/train.py``, whose ``--signal-at RANK:SIGNAL:N`` makes that rank send itself the
signal during its N-th ``actor.update`` (as ``kill -9 <pid>`` from outside would, at a known point).
"""

from __future__ import annotations

import csv
import os
import re
import time
from pathlib import Path

import pytest

from lightning_rlhf.strategy.checkpoint_io import check_resume_path
from tests.conftest import failure_text, run_script

pytestmark = pytest.mark.slow

TIMEOUT = 240  # hard limit of every run: nothing may hang


def pids(proc) -> dict[int, int]:
    """rank -> pid, from the ``[train.py] rank R pid P`` lines."""
    return {int(r): int(p) for r, p in re.findall(r"\[train\.py\] rank (\d+) pid (\d+)", proc.stdout)}


HANG_GUARD_S = 120
"""How long a process may take to go away before the test calls it left over: a guard against a hang, far above
what exiting takes on a busy machine, not a claim about speed."""


def wait_gone(pid: int, within_s: float = HANG_GUARD_S) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    return False


def read_metrics(out: Path) -> list[dict[str, str]]:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def train(demo_model: str, out: Path, *args: str):
    return run_script("train.py", "--model", demo_model, "--out", str(out), "--devices", "2", *args, timeout=TIMEOUT)


def test_sigkill_of_a_worker_is_named_on_rank_0(demo_model: str, tmp_path: Path) -> None:
    proc = train(demo_model, tmp_path, "--steps", "3", "--signal-at", "1:SIGKILL:2")  # TIMEOUT: the hang guard
    ranks = pids(proc)
    assert proc.returncode == 1, failure_text(proc)  # the error's exit status, not a SIGKILL from an observer
    expected = f"RankDiedError: rank 1 (pid {ranks[1]}) died with SIGKILL during actor.update"
    assert expected in proc.stderr, failure_text(proc)
    assert "Connection closed by peer" not in proc.stderr.split("RankDiedError")[-1]  # gloo's words are not the error
    assert wait_gone(ranks[1])


def test_sigkill_of_rank_0_is_named_on_the_worker(demo_model: str, tmp_path: Path) -> None:
    proc = train(demo_model, tmp_path, "--steps", "3", "--signal-at", "0:SIGKILL:2")
    ranks = pids(proc)
    assert proc.returncode == -9, failure_text(proc)
    assert wait_gone(ranks[1]), f"rank 1 outlived rank 0 by more than {HANG_GUARD_S} s"
    # rank 1 shares rank 0's stderr pipe; it raised (exit status 1) naming rank 0 and the call it served.
    assert re.search(rf"RankDiedError: rank 0 \(pid {ranks[0]}\) died .* during actor\.update", proc.stderr), (
        failure_text(proc)
    )


def test_sigterm_on_rank_0_saves_exits_143_and_resumes_like_an_uninterrupted_run(
    demo_model: str, tmp_path: Path
) -> None:
    common = ["--prompts", "8", "--n", "4", "--steps", "4"]
    stopped, resumed, straight = tmp_path / "stopped", tmp_path / "resumed", tmp_path / "straight"
    proc = train(demo_model, stopped, *common, "--signal-at", "0:SIGTERM:2")
    assert proc.returncode == 143, failure_text(proc)
    ckpt = stopped / "checkpoints" / "preempted.ckpt"
    assert f"checkpoint saved to {ckpt}" in proc.stdout
    assert (ckpt / "meta.pt").is_file() and not list(ckpt.parent.glob("*.tmp-*"))
    assert [int(r["step"]) for r in read_metrics(stopped)] == [0, 1]  # stopped after the step it was signalled in
    assert train(demo_model, resumed, *common, "--resume", str(ckpt)).returncode == 0
    assert train(demo_model, straight, *common).returncode == 0
    full, rest = read_metrics(straight), read_metrics(resumed)
    assert [int(r["step"]) for r in rest] == [2, 3]
    for a, b in zip(full[2:], rest, strict=True):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean", "actor/lr"):
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-5, abs=1e-6), key


def test_sigusr1_on_a_worker_stops_every_rank_at_the_same_step(demo_model: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "elsewhere" / "stop.ckpt"
    proc = train(demo_model, tmp_path, "--steps", "3", "--signal-at", "1:SIGUSR1:1", "--preemption-path", str(ckpt))
    assert proc.returncode == 128 + 10, failure_text(proc)
    assert "rank 1: received SIGUSR1" in proc.stderr
    assert f"stopped by SIGUSR1 after step 1: checkpoint saved to {ckpt}" in proc.stdout
    assert (ckpt / "meta.pt").is_file()
    assert [int(r["step"]) for r in read_metrics(tmp_path)] == [0]
    assert wait_gone(pids(proc)[1])


def test_a_save_killed_half_way_leaves_nothing_resume_accepts(demo_model: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "final.ckpt"
    proc = train(demo_model, tmp_path / "run", "--steps", "1", "--save-ckpt", str(ckpt), "--kill-during-save", "0")
    assert proc.returncode == -9, failure_text(proc)
    assert not ckpt.exists() and list(tmp_path.glob("final.ckpt.tmp-*")), "the shards were written, not published"
    assert wait_gone(pids(proc)[1])
    again = train(demo_model, tmp_path / "again", "--steps", "2", "--resume", str(ckpt))
    assert again.returncode != 0
    assert "FileNotFoundError" in again.stderr and "a save that did not finish" in again.stderr, failure_text(again)
    assert "configure_model" not in again.stderr  # refused before any model loaded
    assert not pids(again).get(1), "rank 1 was started: the check came after the launch"


def test_resume_check_refuses_missing_and_incomplete_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="there is no checkpoint at"):
        check_resume_path(tmp_path / "nope.ckpt")
    partial = tmp_path / "partial.ckpt"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"lacks meta\.pt, \.metadata"):
        check_resume_path(partial)
    torn = tmp_path / "torn.ckpt"
    torn.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ValueError, match="not a whole torch checkpoint"):
        check_resume_path(torn)
    check_resume_path("last")  # Lightning's keywords are Lightning's to resolve
    check_resume_path(None)
