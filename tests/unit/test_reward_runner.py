"""The reward runner: real spawned worker processes that hang, crash, raise and get replaced; batches; reuse;
return values of every kind; in-process calls."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_rlhf.rewards import RewardFunctionError, call_reward_fn
from lightning_rlhf.rewards.runner import close_reward_pools, reward_workers

PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4=", "5+5="]
COMPLETIONS = ["2", "4", "7", "8", "10"]
COLUMNS = {"answer": ["2", "4", "6", "8", "10"]}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _close_pools() -> Iterator[None]:
    yield
    close_reward_pools()


def exact(prompts, completions, answer, **kw):
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def gone(pids: list[int], within: float = 60.0) -> bool:  # a hang guard (a busy machine reaps slowly)
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


def pid_reward():
    """A fresh function (defined here, it travels by value: its worker need not import this test module)."""

    def pid_of_worker(prompts, completions, **kw):
        return [float(os.getpid())] * len(completions)

    return pid_of_worker


@pytest.mark.parametrize("timeout_s", [None, 10.0])
def test_scores_come_back_in_order_in_process_and_in_a_worker(timeout_s: float | None) -> None:
    out = call_reward_fn(exact, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=timeout_s)
    assert out.scores.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert not out.failed.any() and out.timeouts == out.crashes == 0


async def judged(prompts, completions, answer, **kw):
    """An ``async def`` reward function (an LLM judge's shape): awaited in its worker or in process."""
    import asyncio

    await asyncio.sleep(0)
    return [float(c == a) for c, a in zip(completions, answer, strict=True)]


@pytest.mark.parametrize("timeout_s", [None, 10.0])
def test_an_async_reward_function_is_awaited(timeout_s: float | None) -> None:
    out = call_reward_fn(judged, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=timeout_s)
    assert out.scores.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0] and not out.failed.any()


def test_worker_is_reused_across_calls_and_is_not_the_trainer() -> None:
    pid_of_worker = pid_reward()
    first = call_reward_fn(pid_of_worker, PROMPTS, COMPLETIONS, {}, timeout_s=10.0)
    second = call_reward_fn(pid_of_worker, PROMPTS, COMPLETIONS, {}, timeout_s=10.0)
    pid = int(first.scores[0])
    assert pid != os.getpid() and int(second.scores[0]) == pid
    assert reward_workers(pid_of_worker).started == 1


def test_worker_is_a_fresh_light_interpreter_with_default_signals() -> None:
    def probe(prompts, completions, **kw):  # a closure: travels by value, imports nothing of the test module
        return [
            float("torch" in sys.modules),
            float(os.environ.get("OMP_NUM_THREADS") == "1"),
            float(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL),
            float(signal.getsignal(signal.SIGINT) == signal.SIG_DFL),
            float(os.getpgid(0) == os.getpid()),  # its own process group
        ]

    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a trainer ignoring SIGTERM: not inherited
    try:
        out = call_reward_fn(probe, ["p"] * 5, ["c"] * 5, {}, timeout_s=30.0)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert out.scores.tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]


def test_lambdas_and_closures_travel_by_value() -> None:
    bonus = {"7": 0.5}
    out = call_reward_fn(
        lambda p, c, **kw: [bonus.get(x, 0.0) + len(x) for x in c], PROMPTS, COMPLETIONS, {}, timeout_s=30.0
    )
    assert out.scores.tolist() == [1.0, 1.0, 1.5, 1.0, 2.0]


def test_function_defined_in_main_of_a_script(tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(
        textwrap.dedent(
            """
            from lightning_rlhf.rewards import call_reward_fn

            def main_reward(prompts, completions, **kw):
                return [float(len(c)) for c in completions]

            out = call_reward_fn(main_reward, ["a", "b"], ["x", "yy"], {}, timeout_s=30.0)
            print("SCORES", out.scores.tolist(), out.crashes, out.timeouts)
            """
        )
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "SCORES [1.0, 2.0] 0 0" in proc.stdout


def test_hanging_function_is_killed_at_the_timeout_with_what_it_started_and_replaced(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"

    def hang_once(prompts, completions, **kw):
        if not pid_file.exists():
            sub = subprocess.Popen(["sleep", "1000"])
            pid_file.write_text(str(sub.pid))
            time.sleep(1000)
        return [float(os.getpid())] * len(completions)

    reward_workers(hang_once).start()
    first_pid = reward_workers(hang_once).pids[0]
    out = call_reward_fn(hang_once, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=1.0, fallback_score=-1.0)
    assert out.scores.tolist() == [-1.0] * 5 and out.failed.all()
    assert (out.timeouts, out.crashes) == (1, 0)
    assert gone([first_pid, int(pid_file.read_text())]), "the worker or its subprocess outlived the timeout"
    nxt = call_reward_fn(hang_once, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=30.0)
    assert not nxt.failed.any() and int(nxt.scores[0]) not in (first_pid, os.getpid())


def test_function_ignoring_sigterm_is_killed_too() -> None:
    def stubborn(prompts, completions, **kw):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(1000)

    out = call_reward_fn(stubborn, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=0.5)
    assert out.timeouts == 1 and out.failed.all()


@pytest.mark.parametrize(
    ("die", "how"),
    [  # lambdas travel by value: the worker does not import this module (and torch) to load them
        (lambda: os._exit(1), "exit code 1"),
        (lambda: os.kill(os.getpid(), signal.SIGSEGV), "SIGSEGV"),
        (lambda: os.kill(os.getpid(), signal.SIGKILL), "SIGKILL"),
    ],
    ids=["os._exit", "SIGSEGV", "SIGKILL"],
)
def test_dying_worker_is_a_crash_and_is_replaced(die, how: str, tmp_path: Path, caplog) -> None:
    flag = tmp_path / "died"

    def dies_once(prompts, completions, **kw):
        if not flag.exists():
            flag.touch()
            die()
        return [1.0] * len(completions)

    out = call_reward_fn(dies_once, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=30.0, fallback_score=0.5)
    assert out.scores.tolist() == [0.5] * 5 and out.failed.all()
    assert (out.timeouts, out.crashes) == (0, 1)
    assert f"crashed on 5 samples: its process died ({how})" in caplog.text
    again = call_reward_fn(dies_once, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=30.0)
    assert again.scores.tolist() == [1.0] * 5 and again.crashes == 0
    assert reward_workers(dies_once).started == 2


def test_worker_killed_while_idle_is_replaced_without_a_failure() -> None:
    pid_of_worker = pid_reward()
    call_reward_fn(pid_of_worker, PROMPTS, COMPLETIONS, {}, timeout_s=10.0)
    (pid,) = reward_workers(pid_of_worker).pids
    os.kill(pid, signal.SIGKILL)
    assert gone([pid])
    out = call_reward_fn(pid_of_worker, PROMPTS, COMPLETIONS, {}, timeout_s=10.0)
    assert not out.failed.any() and out.crashes == 0 and int(out.scores[0]) != pid


def test_exception_raises_with_the_functions_traceback_by_default() -> None:
    def buggy(prompts, completions, answer, **kw):
        return [int(a) / 0 for a in answer]

    with pytest.raises(RewardFunctionError, match=r"reward function `buggy` raised ZeroDivisionError") as info:
        call_reward_fn(buggy, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=10.0)
    assert "return [int(a) / 0 for a in answer]" in str(info.value)  # the worker's frames, as text
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


def test_unpicklable_function_fails_at_once_with_a_hint() -> None:
    lock = threading.Lock()

    def locked(prompts, completions, **kw):
        with lock:
            return [1.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"`locked` cannot be sent to its reward worker.*HINT"):
        call_reward_fn(locked, PROMPTS, COMPLETIONS, {}, timeout_s=10.0)
    assert call_reward_fn(locked, PROMPTS, COMPLETIONS, {}, timeout_s=None).scores.tolist() == [1.0] * 5


def test_function_whose_module_the_worker_cannot_import(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "vanishing_rewards.py").write_text("def far(prompts, completions, **kw):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import vanishing_rewards  # type: ignore[import-not-found]

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])  # the worker gets this path
    try:
        with pytest.raises(RewardFunctionError, match=r"`far` could not be loaded.*ModuleNotFoundError.*HINT"):
            call_reward_fn(vanishing_rewards.far, ["a"], ["b"], {}, timeout_s=30.0)
    finally:
        sys.modules.pop("vanishing_rewards", None)


ACCEPTED = [
    ([1, 0.5], "list"),
    ((1.0, 2), "tuple"),
    (np.array([1.0, 0.5]), "numpy array"),
    (np.array([1, 0], dtype=np.int64), "numpy int array"),
    ([np.float32(1.0), np.int64(2)], "numpy scalars in a list"),
    (torch.tensor([1.0, 0.5]), "tensor"),
    ([torch.tensor(1.0), True], "0-d tensor and a bool"),
]


@pytest.mark.parametrize("timeout_s", [None, 10.0])
def test_any_sequence_of_real_numbers_is_accepted(timeout_s: float | None) -> None:
    for value, kind in ACCEPTED:
        out = call_reward_fn(lambda p, c, v=value, **kw: v, ["a", "b"], ["x", "y"], {}, timeout_s=timeout_s)
        expected = [float(x) for x in (value.tolist() if hasattr(value, "tolist") else value)]
        assert out.scores.tolist() == expected, kind


REFUSED = [
    ([1.0], r"returned 1 values for 2 completions"),
    ([1.0, math.nan], r"returned nan for completion 1"),
    ([1.0, math.inf], r"returned inf for completion 1"),
    ({"a": 1, "b": 2}, r"returned dict; expected a list of 2 floats"),
    ("10", r"returned str; expected a list of 2 floats"),
    (["1.0", "2.0"], r"returned '1.0' for completion 0 .*expected a finite float"),
    ([None, 1.0], r"returned None for completion 0"),
    ([[1.0], [2.0]], r"returned \[1.0\] for completion 0"),
    (np.ones((2, 1)), r"returned a 2-D ndarray of shape \(2, 1\); expected a 1-D sequence.*HINT"),
    (np.float64(1.0), r"returned a 0-D float64"),
    (torch.ones(1, 2), r"returned a 2-D Tensor of shape \(1, 2\)"),
    ({1.0, 2.0}, r"returned set"),
    (np.array([1.0, np.nan]), r"returned nan for completion 1"),
]


@pytest.mark.parametrize("timeout_s", [None, 10.0])
def test_bad_return_values_fail_the_same_in_a_worker_and_in_process(timeout_s: float | None) -> None:
    for value, match in REFUSED:
        with pytest.raises(RewardFunctionError, match=match):
            call_reward_fn(lambda p, c, v=value, **kw: v, ["a", "b"], ["x", "y"], {}, timeout_s=timeout_s)


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

    out = call_reward_fn(hangs_on_seven, PROMPTS, COMPLETIONS, COLUMNS, timeout_s=2.0, batch_size=1, num_workers=5)
    assert out.scores.tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert out.failed.tolist() == [False, False, True, False, False] and out.timeouts == 1


def test_workers_run_calls_at_once(tmp_path: Path) -> None:
    def slow(prompts, completions, **kw):  # records when it ran: the four calls must overlap
        (tmp_path / f"{completions[0]}.start").touch()
        deadline = time.monotonic() + 20
        while len(list(tmp_path.glob("*.start"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        return [float(len(list(tmp_path.glob("*.start"))))] * len(completions)

    out = call_reward_fn(slow, PROMPTS[:4], COMPLETIONS[:4], {}, timeout_s=60.0, batch_size=1, num_workers=4)
    assert out.scores.tolist() == [4.0] * 4  # each call saw all four running
    assert len(set(reward_workers(slow).pids)) == 4


def test_close_ends_the_workers() -> None:
    pid_of_worker = pid_reward()
    pool = reward_workers(pid_of_worker)
    pool.start(2)
    pids = pool.pids
    assert len(pids) == 2 and all(alive(p) for p in pids)
    close_reward_pools([pid_of_worker])
    assert pool.closed and gone(pids, within=0.1)


def test_workers_die_with_the_trainer(tmp_path: Path) -> None:
    script = tmp_path / "trainer.py"
    script.write_text(
        textwrap.dedent(
            """
            import time
            from lightning_rlhf.rewards.runner import call_reward_fn, reward_workers

            fn = lambda p, c, **kw: [1.0] * len(c)
            call_reward_fn(fn, ["a"], ["b"], {}, timeout_s=30.0, num_workers=2, batch_size=1)
            print("PIDS", *reward_workers(fn).pids, flush=True)
            time.sleep(1000)
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and all(alive(p) for p in pids), line
    finally:
        proc.kill()
        proc.wait()
    assert gone(pids), "reward workers outlived the trainer (SIGKILL)"
