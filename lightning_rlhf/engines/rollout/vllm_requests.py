"""The vLLM engine's requests at TP 1: each request joins the running ones at vLLM's next scheduling step (an episode's
next turn starts as soon as its observation is ready), and each step hands on the requests that finished in it.
vLLM's in-process engine is stepped here rather than through its ``AsyncLLM`` (docs/architecture.md, "Rollouts as
requests")."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Protocol

from lightning_rlhf.compat import vllm as vllm_compat
from lightning_rlhf.engines.rollout.requests import Completion, Done, Request, SamplingParams

__all__ = ["VLLMEngine", "VLLMRequestQueue"]


class VLLMEngine(Protocol):
    """What :class:`VLLMRequestQueue` needs of the colocated vLLM engine."""

    llm: Any
    """vLLM's ``LLM``."""
    lora: Any
    """The ``LoRARequest`` of the adapters requests use (None: the base weights)."""

    @property
    def asleep(self) -> bool:
        """Whether some of the engine's memory is asleep."""
        ...

    @property
    def weights_discarded(self) -> bool:
        """Whether the engine holds no valid weights."""
        ...

    def check_prompts(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """Refuse what vLLM would fail on later."""
        ...

    def vllm_params(self, params: SamplingParams, seed: int, *, final_only: bool = False) -> Any:
        """vLLM's sampling settings for ``params``."""
        ...


class VLLMRequestQueue:
    """Requests on a vLLM engine of one rank, decoded continuously (a
    :class:`~lightning_rlhf.engines.rollout.requests.RequestQueue`). Runs on: the rollout's process."""

    def __init__(self, engine: VLLMEngine) -> None:
        self.engine = engine
        # running requests: our id -> ((the name we gave vLLM, vLLM's own id), the request); each of the two names (the
        # same or not, by vLLM's version; its outputs carry one of them) -> ours
        self._running: dict[str, tuple[tuple[str, str], Request]] = {}
        self._ours: dict[str, str] = {}
        self._counter = itertools.count()

    def add(self, requests: Sequence[Request]) -> None:
        """Queue ``requests`` in vLLM; they decode from the next :meth:`step` on. Checked as ``generate`` checks its
        prompts. Runs on: the rollout's process."""
        from vllm.inputs import TokensPrompt

        engine = engine_ready(self.engine)
        for request in requests:
            request.params.check()
            engine.check_prompts([request.prompt], request.params)
            params = dataclasses.replace(request.params, n=1)
            sampling = engine.vllm_params(params, params.seed, final_only=True)
            name = f"lrlhf-{request.id}-{next(self._counter)}"
            internal = vllm_compat.add_request(
                engine.llm, name, TokensPrompt(prompt_token_ids=request.prompt), sampling, engine.lora
            )
            self._running[request.id] = ((name, internal), request)
            self._ours[internal] = self._ours[name] = request.id

    def step(self, done: Done, busy: bool) -> bool:
        """One scheduling step of the running requests (none: nothing runs); each that finished to ``done``. Runs on:
        the rollout's process."""
        if not self._running:
            return busy
        for out in vllm_compat.step(self.engine.llm):
            if not out.finished:
                continue
            ours = self._ours.get(str(out.request_id))
            if ours is None or ours not in self._running:  # aborted meanwhile
                continue
            request = self._forget(ours)
            samples: Any = out.outputs  # a generation request's completions (pooling requests are never added)
            ids, lps = vllm_ids_and_logprobs(samples[0])
            done(Completion(request.id, ids, lps, "length" if samples[0].finish_reason == "length" else "stop"))
        return busy

    def abort(self, ids: Iterable[str]) -> list[Completion]:
        """End running requests ``ids`` in vLLM (their tokens so far are not read back). Runs on: the rollout's
        process."""
        gone = [ours for ours in ids if ours in self._running]
        internal = [self._running[ours][0][1] for ours in gone]
        for ours in gone:
            self._forget(ours)
        if gone:
            vllm_compat.abort_requests(self.engine.llm, internal)
        return [Completion(ours, [], [], "abort") for ours in gone]

    def _forget(self, ours: str) -> Request:
        """Drop request ``ours`` and both its names; returns it."""
        names, request = self._running.pop(ours)
        for name in names:
            self._ours.pop(name, None)
        return request

    def pending(self) -> int:
        """How many requests run. Runs on: the rollout's process."""
        return len(self._running)

    def interrupt(self) -> None:
        """Not offered (the tokens of an aborted request are not read back): a step is one scheduling step, so a
        pause waits at most that long. Runs on: any thread."""

    def end_sessions(self, sessions: Iterable[Hashable]) -> None:
        """Nothing is kept per session (vLLM's prefix cache serves a session's next turn). Runs on: the rollout's
        process."""


def engine_ready(engine: VLLMEngine) -> VLLMEngine:
    """``engine``, refused while it is asleep or holds no weights (vLLM would queue the requests and never run them).
    Runs on: the rollout's process."""
    if engine.asleep or engine.weights_discarded:
        raise RuntimeError("VLLMRolloutEngine.requests: the engine is asleep or holds no weights.")
    return engine


def vllm_ids_and_logprobs(sample: Any) -> tuple[list[int], list[float]]:
    """A vLLM sample's token ids and the engine's log-prob of each (``logprobs=0``: the sampled token's only). Runs on:
    the rollout's process."""
    ids = list(sample.token_ids)
    steps: list[Any] = list(sample.logprobs or [])
    return ids, [float(step[tok].logprob) for step, tok in zip(steps, ids, strict=True)]
