"""The reward runner: real forked processes that hang, crash and raise; batches; in-process calls."""

from __future__ import annotations

import faulthandler
import math
import multiprocessing
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from lightning_rlhf.rewards import RewardFunctionError, call_reward_fn

PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4=", "5+5="]
COMPLETIONS = ["2", "4", "7", "8", "10"]
COLUMNS = {"answer": ["2", "4", "6", "8", "10"]}


def exact(prompts, completions, answer, **kw):
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped by init, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("timeout_s", [None, 10.0])
def test_scores_come_back_in_order_in_process_and_forked(timeout_s: float | None) -> None:
    out = call_reward_fn(exact, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=timeout_s)
    assert out.scores.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert not out.failed.any() and out.timeouts == out.crashes == 0


def test_hanging_function_is_killed_at_the_timeout_with_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"

    def hang(prompts, completions, **kw):  # a closure: runs in the fork without pickling
        sub = subprocess.Popen(["sleep", "1000"])
        pid_file.write_text(str(sub.pid))
        time.sleep(1000)

    t0 = time.monotonic()
    out = call_reward_fn(hang, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=1.0, fallback_score=-1.0)
    assert time.monotonic() - t0 < 1.0 + 2.0
    assert out.scores.tolist() == [-1.0] * 5 and out.failed.all()
    assert (out.timeouts, out.crashes) == (1, 0)
    assert not multiprocessing.active_children()  # the child is killed and reaped
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 2.0
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild), "the function's own subprocess outlived the timeout"


def test_function_ignoring_sigterm_is_killed_too() -> None:
    def stubborn(prompts, completions, **kw):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(1000)

    t0 = time.monotonic()
    out = call_reward_fn(stubborn, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=0.5)
    assert time.monotonic() - t0 < 0.5 + 2.5 and out.timeouts == 1 and out.failed.all()
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    "die",
    [
        lambda: os._exit(1),
        lambda: (faulthandler.disable(), os.kill(os.getpid(), signal.SIGSEGV)),  # no stack dump from pytest's handler
        lambda: os.kill(os.getpid(), signal.SIGKILL),
    ],
    ids=["os._exit", "SIGSEGV", "SIGKILL"],
)
def test_dying_process_is_a_crash(die) -> None:
    out = call_reward_fn(lambda p, c, **kw: die(), PROMPTS, COMPLETIONS, COLUMNS, timeout_s=10.0, fallback_score=0.5)
    assert out.scores.tolist() == [0.5] * 5 and out.failed.all()
    assert (out.timeouts, out.crashes) == (0, 1)


def test_exception_raises_with_the_functions_traceback_by_default() -> None:
    def buggy(prompts, completions, answer, **kw):
        return [int(a) / 0 for a in answer]

    with pytest.raises(RewardFunctionError, match=r"reward function `buggy` raised ZeroDivisionError") as info:
        call_reward_fn(buggy, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=10.0)
    assert "return [int(a) / 0 for a in answer]" in str(info.value)  # the child's frames, as text
    assert "in buggy" in info.value.traceback_text
    assert "dataset columns passed: ['answer']" in str(info.value)
    with pytest.raises(RewardFunctionError, match=r"`buggy` raised ZeroDivisionError") as info:
        call_reward_fn(buggy, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=None)
    assert "in buggy" in info.value.traceback_text


@pytest.mark.parametrize("timeout_s", [None, 10.0])
def test_exception_falls_back_when_configured(timeout_s: float | None) -> None:
    out = call_reward_fn(
        lambda p, c, **kw: 1 / 0, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=timeout_s, on_exception="fallback"
    )
    assert out.scores.tolist() == [0.0] * 5 and out.failed.all() and out.crashes == 1


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda p, c, **kw: [1.0], r"returned 1 values for 2 completions"),
        (lambda p, c, **kw: [1.0, math.nan], r"returned nan for completion 1"),
        (lambda p, c, **kw: {"a": 1}, r"returned dict; expected a list of 2 floats"),
    ],
)
def test_bad_return_values_in_a_child_fail_as_in_process(fn, match: str) -> None:
    with pytest.raises(RewardFunctionError, match=match):
        call_reward_fn(fn, ["a", "b"], ["x", "y"], {}, timeout_s=10.0)


@pytest.mark.parametrize("timeout_s", [None, 10.0])
def test_batches_of_n_samples_with_their_own_columns(timeout_s: float | None) -> None:
    def sizes(prompts, completions, answer, **kw):  # batch size + the sample's own answer, to check the slicing
        return [len(completions) * 100 + int(a) for a in answer]

    out = call_reward_fn(sizes, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=timeout_s, batch_size=2, num_workers=2)
    assert out.scores.tolist() == [202, 204, 206, 208, 110]


def test_a_hang_costs_only_its_own_batch() -> None:
    def hangs_on_seven(prompts, completions, **kw):
        if "7" in completions:
            time.sleep(1000)
        return [1.0] * len(completions)

    out = call_reward_fn(hangs_on_seven, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=1.0, batch_size=1, num_workers=5)
    assert out.scores.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert out.failed.tolist() == [False, False, True, False, False] and out.timeouts == 1


def test_workers_run_batches_at_once() -> None:
    def slow(prompts, completions, **kw):
        time.sleep(1.0)
        return [1.0] * len(completions)

    t0 = time.monotonic()
    out = call_reward_fn(slow, PROMPTS[:4], COMPLETIONS[:4], {}, timeout_s=10.0, batch_size=1, num_workers=4)
    assert out.scores.tolist() == [1.0] * 4
    assert time.monotonic() - t0 < 3.0  # 4 s one after another
