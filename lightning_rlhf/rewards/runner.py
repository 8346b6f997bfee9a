"""Calling a reward function: in-process, or in long-lived reward worker processes (``rewards.pool``) with a
per-call timeout. A call that times out or whose worker dies gives its samples the fallback score; an exception
stops the run by default (``on_exception="raise"``: it is usually a bug). The behaviour: docs/rewards.md.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch

from lightning_rlhf.rewards.pool import RewardPool, close_reward_pools, reward_pool
from lightning_rlhf.sandbox import IN_PROCESS, ScoresError, as_scores, awaited, raised_message

__all__ = [
    "IN_PROCESS",
    "RewardFn",
    "RewardFunctionError",
    "RewardOutcome",
    "RewardPool",
    "call_reward_fn",
    "check_scores",
    "close_reward_pools",
    "reward_fn_name",
    "reward_workers",
]

log = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[float]]
"""``fn(prompts: list[str], completions: list[str], **dataset_columns) -> list[float]`` (TRL's convention)."""

OnException = Literal["raise", "fallback"]


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
    error: Exception | None = None  # in-process only (a worker process sends the traceback as text)


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
    """Score ``B`` ``completions`` with ``fn(prompts, completions, **columns)``, ``batch_size`` samples per call
    (None: one call); samples whose call timed out or crashed get ``fallback_score``. ``name``: how the function is
    named in messages (default: its ``__name__``).

    Runs on: the worker that holds the samples (each rank scores its share). With ``timeout_s=None`` the
    calls run in this process, one after another (no isolation: a hang hangs the run); otherwise each call
    runs in one of ``fn``'s reward worker processes, up to ``num_workers`` at once, and is killed after
    ``timeout_s`` seconds. The workers are started on first use (or by :meth:`RewardPool.start`) and kept
    for the next calls; ``close_reward_pools`` ends them (at the latest, at interpreter exit).
    ``on_exception="fallback"``: an exception in ``fn`` (or a bad return value) is scored like a crash.

    Raises:
        RewardFunctionError: ``fn`` raised or returned something other than ``B`` finite numbers, and
            ``on_exception="raise"``; or ``timeout_s`` is set and ``fn`` cannot be pickled.
    """
    name = name or reward_fn_name(fn)
    n = len(prompts)
    size = max(1, batch_size or n)
    spans = [(start, min(start + size, n)) for start in range(0, n, size)]
    calls = [
        (list(prompts[a:b]), list(completions[a:b]), {k: list(v[a:b]) for k, v in columns.items()}) for a, b in spans
    ]
    if timeout_s is None or getattr(fn, IN_PROCESS, False):
        results = [_call_here(fn, name, *call) for call in calls]
    else:
        pool = reward_workers(fn, name=name)
        run = pool.run(calls, timeout_s=timeout_s, num_workers=num_workers, name=name)
        results = [_CallResult(*result) for result in run]  # type: ignore[arg-type]
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


def reward_workers(fn: RewardFn, *, name: str | None = None) -> RewardPool:
    """The pool of reward worker processes that runs ``fn`` when it has a timeout (made on first use, kept).

    Runs on: the worker that scores. Call ``.start(num_workers)`` on it to start the workers ahead of the first
    call; :func:`close_reward_pools` ends them.

    Raises:
        RewardFunctionError: ``fn`` cannot be pickled with cloudpickle (the message says what to change).
    """
    try:
        return reward_pool(fn, name=name or reward_fn_name(fn))
    except TypeError as err:
        raise RewardFunctionError(str(err)) from err


def check_scores(values: Any, *, name: str, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
    """``values`` as one finite float per completion (as :func:`~lightning_rlhf.sandbox.as_scores` reads them),
    or a :class:`RewardFunctionError` saying what is wrong.

    Runs on: wherever the reward function ran (the worker, or its reward worker process).
    """
    try:
        return as_scores(values, name=name, prompts=prompts, completions=completions)
    except ScoresError as err:
        raise RewardFunctionError(str(err)) from None


def _call_here(
    fn: RewardFn, name: str, prompts: list[str], completions: list[str], columns: dict[str, list[Any]]
) -> _CallResult:
    try:
        values = awaited(fn(prompts, completions, **columns))
    except Exception as err:
        tb = traceback.format_exc()
        return _CallResult("raised", message=raised_message(name, err, prompts, columns), traceback=tb, error=err)
    try:
        return _CallResult("ok", check_scores(values, name=name, prompts=prompts, completions=completions))
    except RewardFunctionError as err:
        return _CallResult("invalid", message=str(err))
