"""The rollout engine interface every generator implements (transformers now, vLLM next)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from torch import Tensor

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Sampling settings of one generate call (validated upstream by ``RolloutConfig``)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    greedy: bool = False


@dataclasses.dataclass
class RolloutOutput:
    """Responses of one generate call, ``n`` consecutive samples per prompt.

    ``responses[i]`` holds the generated token ids up to and including the first stop token (EOS or one of
    ``stop_token_ids``), or ``max_new_tokens`` ids if none came. ``logprobs[i]``, when the engine reports
    them, are its own log-probabilities of those tokens.
    """

    responses: list[list[int]]
    logprobs: list[list[float]] | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """What the actor role needs from a generator. Runs on: every worker rank, each on its own prompts."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> RolloutOutput:
        """Sample ``params.n`` responses for each prompt (token ids without padding)."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> int:
        """Take new weights (transformers parameter names, full tensors); returns the bytes received."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory while training runs (a no-op where that is not possible)."""
        ...

    def wake_up(self) -> None:
        """Undo :meth:`sleep` before generating."""
        ...
