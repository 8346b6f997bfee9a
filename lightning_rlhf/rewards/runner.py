"""Calling a reward function: in-process, or in forked child processes with a per-call timeout.

A reward function is user code run on every step: it may hang (a regex that backtracks forever, a sympy
simplification, a sandbox that never answers) or crash the interpreter (a segfault in a C extension,
``os._exit``). With ``timeout_s`` set, each call runs in a child forked from the worker (so closures and
lambdas need no pickling; only the scores come back, through a pipe). A call that outlives ``timeout_s`` is
killed with its whole process group, and a child that dies is a crash: both give the call's samples the
fallback score, and both are counted. A Python exception raised by the function is usually a bug, so by
default it stops the run with the function's traceback (``on_exception="raise"``); ``"fallback"`` treats it
like a crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

import torch

__all__ = ["RewardFn", "RewardFunctionError", "RewardOutcome", "call_reward_fn", "check_scores", "reward_fn_name"]

log = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float]]
"""``fn(prompts: list[str], completions: list[str], **dataset_columns) -> list[float]`` (TRL's convention)."""

OnException = Literal["raise", "fallback"]
_TERM_GRACE_S = 1.0  # SIGTERM first (the function's `finally` blocks run), SIGKILL after this long


class RewardFunctionError(RuntimeError):
    """The reward function raised, or returned something other than one finite number per completion.

    Attributes:
        traceback_text: the function's own traceback, formatted where it ran ("" for a bad return value).
    """

    def __init__(self, message: str, *, traceback_text: str = "") -> None:
        super().__init__(message)
        self.traceback_text = traceback_text


@dataclasses.dataclass(frozen=True)
class RewardOutcome:
    """The scores of one reward function over a rank's samples, and which samples got the fallback.

    Attributes:
        scores: ``[B]`` float32, the fallback score where ``failed``.
        failed: ``[B]`` bool, samples whose call timed out, crashed (or raised, with ``on_exception="fallback"``).
        timeouts: calls killed at the timeout.
        crashes: calls whose process died (or raised, with ``on_exception="fallback"``).
    """

    scores: torch.Tensor
    failed: torch.Tensor
    timeouts: int = 0
    crashes: int = 0


@dataclasses.dataclass
class _CallResult:
    kind: Literal["ok", "raised", "invalid", "timeout", "crash"]
    scores: list[float] | None = None
    message: str = ""
    traceback: str = ""
    error: Exception | None = None  # in-process only (the child sends the traceback as text)


def reward_fn_name(fn: Callable[..., Any]) -> str:
    """The name a reward function is reported by: its ``__name__`` (a class instance: its class name)."""
    return str(getattr(fn, "__name__", type(fn).__name__))


def call_reward_fn(
    fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: Mapping[str, Sequence[Any]],
    *,
    timeout_s: float | None,
    fallback_score: float = 0.0,
    batch_size: int | None = None,
    num_workers: int = 1,
    on_exception: OnException = "raise",
    name: str | None = None,
) -> RewardOutcome:
    """Score ``completions`` with ``fn``, ``batch_size`` samples per call.

    Runs on: the worker that holds the samples (each rank scores its share). With ``timeout_s=None`` the
    calls run in this process, one after another (no isolation: a hang hangs the run); otherwise each call
    runs in a forked child, up to ``num_workers`` at once, and is killed after ``timeout_s`` seconds.

    Args:
        fn: ``fn(prompts, completions, **columns) -> list[float]``.
        prompts: ``B`` prompt texts.
        completions: ``B`` decoded responses.
        columns: dataset columns, ``B`` values each, passed to ``fn`` as keyword arguments.
        timeout_s: seconds one call may take; None: call in-process, without a timeout.
        fallback_score: the score of a sample whose call timed out or crashed.
        batch_size: samples per call; None: all ``B`` in one call.
        num_workers: child processes running at once (with ``timeout_s`` set).
        on_exception: ``"raise"``: an exception in ``fn`` (or a bad return value) raises
            :class:`RewardFunctionError` with its traceback; ``"fallback"``: the call's samples get the
            fallback score and count as crashed.
        name: how the function is named in messages; defaults to its ``__name__``.

    Returns:
        The scores ``[B]``, the failed samples ``[B]`` and the number of timed-out and crashed calls.

    Raises:
        RewardFunctionError: ``fn`` raised or returned something other than ``B`` finite numbers, and
            ``on_exception="raise"``.
    """
    name = name or reward_fn_name(fn)
    n = len(prompts)
    size = max(1, batch_size or n)
    spans = [(start, min(start + size, n)) for start in range(0, n, size)]
    calls = [
        (list(prompts[a:b]), list(completions[a:b]), {k: list(v[a:b]) for k, v in columns.items()}) for a, b in spans
    ]
    if timeout_s is None:
        results = [_call_here(fn, name, *call) for call in calls]
    else:
        results = _call_in_children(fn, name, calls, timeout_s=timeout_s, num_workers=num_workers)
    scores = torch.full((n,), float(fallback_score), dtype=torch.float32)
    failed = torch.zeros(n, dtype=torch.bool)
    timeouts = crashes = 0
    for (a, b), result in zip(spans, results, strict=True):
        if result.kind == "ok":
            assert result.scores is not None
            scores[a:b] = torch.tensor(result.scores, dtype=torch.float32)
            continue
        if result.kind in ("raised", "invalid") and on_exception == "raise":
            raise RewardFunctionError(result.message, traceback_text=result.traceback) from result.error
        failed[a:b] = True
        timeouts += result.kind == "timeout"
        crashes += result.kind != "timeout"
        log.warning("%s; they get the fallback score %s.", result.message.splitlines()[0], fallback_score)
    return RewardOutcome(scores=scores, failed=failed, timeouts=timeouts, crashes=crashes)


def check_scores(values: Any, *, name: str, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
    """``values`` as one finite float per completion, or a :class:`RewardFunctionError` saying what is wrong.

    Runs on: wherever the reward function ran (the worker, or its child process).
    """
    if not isinstance(values, Sequence | torch.Tensor) or isinstance(values, str):
        raise RewardFunctionError(
            f"reward function `{name}` returned {type(values).__name__}; expected a list of "
            f"{len(prompts)} floats, one per completion."
        )
    if len(values) != len(prompts):
        raise RewardFunctionError(
            f"reward function `{name}` returned {len(values)} values for {len(prompts)} completions; "
            "expected exactly one float per completion."
        )
    out = []
    for i, v in enumerate(values):
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = math.nan
        if not math.isfinite(f):
            raise RewardFunctionError(
                f"reward function `{name}` returned {v!r} for completion {i} "
                f"(prompt {prompts[i]!r}, completion {completions[i]!r}); expected a finite float. "
                "HINT: return 0.0 (or another fallback) for completions you cannot score."
            )
        out.append(f)
    return out


# ------------------------------------------------------------------------------------ in this process
def _raised_message(name: str, err: BaseException, prompts: list[str], columns: Mapping[str, Any]) -> str:
    return (
        f"reward function `{name}` raised {type(err).__name__}: {err} "
        f"(called on {len(prompts)} completions; dataset columns passed: {sorted(columns)})"
    )


def _call_here(
    fn: RewardFn, name: str, prompts: list[str], completions: list[str], columns: dict[str, list[Any]]
) -> _CallResult:
    try:
        values = fn(prompts, completions, **columns)
    except Exception as err:
        tb = traceback.format_exc()
        return _CallResult("raised", message=_raised_message(name, err, prompts, columns), traceback=tb, error=err)
    try:
        return _CallResult("ok", check_scores(values, name=name, prompts=prompts, completions=completions))
    except RewardFunctionError as err:
        return _CallResult("invalid", message=str(err))


# ------------------------------------------------------------------------------------- in children
def _child_main(
    conn: Connection,
    parent: int,
    fn: RewardFn,
    name: str,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list[Any]],
) -> None:
    """Body of the forked child: own process group, die with the parent, call, send the result, exit."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # the parent kills the whole group: nothing the function started outlives the call
    _die_with_parent(parent)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the trainer's handlers (Lightning catches SIGTERM)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    result = _call_here(fn, name, prompts, completions, columns)
    if result.kind == "raised":  # the parent cannot chain the exception: it gets the traceback as text
        result.message += f"\n--- traceback of `{name}` (in its reward process) ---\n{result.traceback}"
        result.error = None  # exceptions need not pickle
    with contextlib.suppress(Exception):  # before sending: the parent may kill this process once it has the result
        sys.stdout.flush()
        sys.stderr.flush()
    try:
        conn.send_bytes(pickle.dumps(result))
    finally:
        os._exit(0)  # no atexit handlers, no process-group teardown: those belong to the trainer


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this child if the trainer dies first (no orphaned reward process)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _call_in_children(
    fn: RewardFn,
    name: str,
    calls: list[tuple[list[str], list[str], dict[str, list[Any]]]],
    *,
    timeout_s: float,
    num_workers: int,
) -> list[_CallResult]:
    ctx = multiprocessing.get_context("fork")
    results: list[_CallResult | None] = [None] * len(calls)
    pending = list(enumerate(calls))
    running: dict[Connection, tuple[int, Any, float]] = {}  # read end -> (call index, process, deadline)
    try:
        while pending or running:
            while pending and len(running) < max(1, num_workers):
                i, call = pending.pop(0)
                recv, send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_child_main, args=(send, os.getpid(), fn, name, *call), name=f"reward-{name}")
                with warnings.catch_warnings():  # Python 3.12+ warns on fork() in a multi-threaded process
                    warnings.simplefilter("ignore", DeprecationWarning)
                    proc.start()
                send.close()
                assert proc.pid is not None
                with contextlib.suppress(OSError):
                    os.setpgid(proc.pid, proc.pid)  # also here: no race with a kill before the child ran
                running[recv] = (i, proc, time.monotonic() + timeout_s)
            soonest = min(deadline for _, _, deadline in running.values())
            for conn in wait(list(running), timeout=max(0.0, soonest - time.monotonic())):
                assert isinstance(conn, Connection)
                i, proc, _ = running.pop(conn)
                results[i] = _receive(conn, proc, name, samples=len(calls[i][0]))
            now = time.monotonic()
            for conn, (i, proc, deadline) in list(running.items()):
                if now >= deadline:
                    del running[conn]
                    _kill(proc)
                    conn.close()
                    n = len(calls[i][0])
                    results[i] = _CallResult(
                        "timeout", message=f"reward function `{name}` timed out after {timeout_s:g} s on {n} samples"
                    )
    finally:  # an error (or KeyboardInterrupt) while calls run: leave no child behind
        for conn, (_, proc, _) in running.items():
            _kill(proc)
            conn.close()
    return [r for r in results if r is not None]


def _receive(conn: Connection, proc: Any, name: str, *, samples: int) -> _CallResult:
    """The child's result, or a crash if it died without sending one."""
    try:
        result: _CallResult = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        proc.join(_TERM_GRACE_S)
        code = proc.exitcode
        how = f"exit code {code}" if code is None or code >= 0 else signal.Signals(-code).name
        _kill(proc)
        message = f"reward function `{name}` crashed on {samples} samples: its process died ({how})"
        return _CallResult("crash", message=message)
    finally:
        conn.close()
    # The child is exiting; end anything it left running in its group too. Not waiting for the exit (tearing
    # down a copy of a large trainer's address space takes as long as the fork): multiprocessing reaps it at
    # the next fork, or at interpreter exit.
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    return result


def _kill(proc: Any) -> None:
    """SIGTERM the child's process group, SIGKILL whatever is left after a grace period, reap the child."""
    if proc.is_alive():
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.terminate()
        proc.join(_TERM_GRACE_S)
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)  # grandchildren too (the child's own group, never ours)
    if proc.is_alive():
        proc.kill()
    proc.join()
