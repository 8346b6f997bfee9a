"""The sandbox: user code (reward functions, tools) run apart from the trainer, in worker processes that are fresh
interpreters (``subprocess``, never a fork of a process with threads), each in its own process group, with a
per-call timeout, killed with what they started, and dead with their parent. Shared by the reward pool
(:mod:`lightning_rlhf.rewards.pool`) and the tool executor (:mod:`lightning_rlhf.sandbox.tools`).

- :mod:`~lightning_rlhf.sandbox.worker`: the worker's program, standard library only (it runs as a script).
- :mod:`~lightning_rlhf.sandbox.process`: the parent side: start, feed, kill and reap a worker.
- :mod:`~lightning_rlhf.sandbox.tools`: :class:`ToolExecutor`, tool calls in workers.

Standard library only (``cloudpickle`` when a pool or executor is made): importing it never imports torch.
"""

from lightning_rlhf.sandbox.process import (
    IN_PROCESS,
    STARTUP_TIMEOUT_S,
    WORKER_ENV,
    WORKER_PROGRAM,
    Worker,
    kill_worker,
    spawn_worker,
    worker_payload,
)
from lightning_rlhf.sandbox.tools import ToolExecutor, ToolResult, tool_result
from lightning_rlhf.sandbox.worker import (
    ScoresError,
    as_scores,
    awaited,
    raised_message,
    tool_answer,
    tool_result_text,
)

__all__ = [
    "IN_PROCESS",
    "STARTUP_TIMEOUT_S",
    "WORKER_ENV",
    "WORKER_PROGRAM",
    "ScoresError",
    "ToolExecutor",
    "ToolResult",
    "Worker",
    "as_scores",
    "awaited",
    "kill_worker",
    "raised_message",
    "spawn_worker",
    "tool_answer",
    "tool_result",
    "tool_result_text",
    "worker_payload",
]
