"""The transformers engine's requests: one call of its decoding loop per step over everything queued, each request
bounded by its own ``max_new_tokens``; a session's next turn goes on from the keys and values its last turn left (only
its new tokens run through the model), and a request that ends is handed on while the others still decode (a
multi-turn episode starts its tools at once)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Protocol

from lightning_rlhf.engines.rollout.requests import (
    BatchedRequestQueue,
    Done,
    Generator,
    Request,
    RolloutOutput,
    SamplingParams,
    completion_of,
    shared_prompts,
)

__all__ = ["HFRequestQueue", "SessionEngine"]


class SessionEngine(Generator, Protocol):
    """What :class:`HFRequestQueue` needs of the transformers engine: its ``sample`` with kept sessions."""

    def sample(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        continues: Sequence[Hashable | None] | None = None,
        keep_as: Sequence[Hashable] | None = None,
        limits: Sequence[int] | None = None,
        on_done: Callable[[int, list[int], list[float]], None] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> RolloutOutput:
        """``generate`` with kept sessions, a bound per prompt, early completions and an interrupt."""
        ...

    def drop_sessions(self, sessions: Iterable[Hashable] | None = None) -> None:
        """Drop the kept sequences of ``sessions``."""
        ...

    @property
    def eos_token_id(self) -> int:
        """The id that ends every response."""
        ...


class HFRequestQueue(BatchedRequestQueue):
    """:class:`~lightning_rlhf.engines.rollout.requests.BatchedRequestQueue` on ``HFRolloutEngine.sample``: one call per
    sampling setting (each prompt bounded by its own request, so requests near the end of the context share the
    others' call), sessions continued from their kept keys and values. Requests added while a step decodes wait for the
    next step. Runs on: the rollout's process."""

    engine: SessionEngine

    def __init__(self, engine: SessionEngine) -> None:
        super().__init__(engine)
        self._stop = threading.Event()

    def interrupt(self) -> None:
        """End the running step at its next decoding step (see ``RequestQueue.interrupt``). Runs on: any thread."""
        self._stop.set()

    def step(self, done: Done, busy: bool) -> bool:
        """One call of the decoding loop per sampling setting over everything queued (see the class). Runs on: the
        rollout's process."""
        try:
            return super().step(done, busy)
        finally:
            self._stop.clear()

    def calls(self, requests: list[Request]) -> list[tuple[list[Request], SamplingParams]]:  # type: ignore[override]
        """One call per sampling setting, bounded by its largest request. Runs on: the rollout's process."""
        by_settings: dict[SamplingParams, list[Request]] = {}
        for request in requests:
            by_settings.setdefault(dataclasses.replace(request.params, seed=0, max_new_tokens=1), []).append(request)
        return [
            (group, dataclasses.replace(group[0].params, max_new_tokens=max(r.params.max_new_tokens for r in group)))
            for group in by_settings.values()
        ]

    def serve(self, group: list[Request], params: SamplingParams, done: Done) -> None:
        """One call of the engine for ``group``: each request's completion to ``done`` as soon as it ends. Requests with
        images go through ``generate`` from their whole prompt (the kept keys and values are text-only). Runs on: the
        rollout's process."""
        images = [r for r in group if r.vision is not None]
        if images:
            super().serve(images, params, done)
            group = [r for r in group if r.vision is None]
            if not group:
                return
        group, copies = shared_prompts(group)
        heads = group[::copies]
        sessions = [r.session for r in group]
        handed: set[int] = set()

        def early(k: int, ids: list[int], logprobs: list[float]) -> None:
            handed.add(k)
            done(completion_of(group[k], ids, logprobs))

        out = self.engine.sample(
            [r.prompt for r in heads],
            dataclasses.replace(params, n=copies),
            continues=[r.session for r in heads],
            keep_as=None if None in sessions else sessions,
            limits=[r.params.max_new_tokens for r in heads],
            on_done=early,
            stop=self._stop.is_set,
        )
        logprobs = out.logprobs or [[] for _ in out.responses]
        interrupted = self._stop.is_set()
        for k, (ids, lps) in enumerate(zip(out.responses, logprobs, strict=True)):
            if k in handed:
                continue
            completion = completion_of(group[k], ids, lps)
            ended = bool(ids) and ids[-1] in {self.engine.eos_token_id, *group[k].params.stop_token_ids}
            if interrupted and not ended and len(ids) < group[k].params.max_new_tokens:  # cut by the interrupt
                completion = dataclasses.replace(completion, reason="abort")
            done(completion)

    def end_sessions(self, sessions: Iterable[Hashable]) -> None:
        """Drop the keys and values kept for ``sessions``. Runs on: the rollout's process."""
        self.engine.drop_sessions(sessions)
