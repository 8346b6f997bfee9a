"""The vLLM engine's requests at TP 1: each request joins the running ones at vLLM's next scheduling step (an episode's
next turn starts as soon as its observation is ready), and each step hands on the requests that finished in it.
An interrupt ends every running request at the next step with the tokens it has so far, read from vLLM's request
state before the abort (partial rollouts); outputs stay ``FINAL_ONLY`` (per-step outputs cost ~10% of a decoding
step of a tiny model, docs/performance-log.md). vLLM's in-process engine is stepped here rather than through its
``AsyncLLM`` (docs/architecture.md, "Rollouts as requests")."""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Protocol

from lightning_rlhf.compat import vllm as vllm_compat
from lightning_rlhf.engines.rollout.requests import Completion, Done, Request, SamplingParams

__all__ = ["RemoteQueueHost", "ServerRequestQueue", "VLLMEngine", "VLLMRequestQueue"]


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

    def prompt_input(self, ids: list[int], vision: Any) -> Any:
        """vLLM's input for one prompt (its ids, and its images)."""
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
        self._interrupt = threading.Event()

    def add(self, requests: Sequence[Request]) -> None:
        """Queue ``requests`` in vLLM; they decode from the next :meth:`step` on. Checked as ``generate`` checks its
        prompts. Runs on: the rollout's process."""
        engine = engine_ready(self.engine)
        for request in requests:
            request.params.check()
            engine.check_prompts([request.prompt], request.params)
            params = dataclasses.replace(request.params, n=1)
            sampling = engine.vllm_params(params, params.seed, final_only=True)
            name = f"lrlhf-{request.id}-{next(self._counter)}"
            prompt = engine.prompt_input(request.prompt, request.vision)
            internal = vllm_compat.add_request(engine.llm, name, prompt, sampling, engine.lora)
            self._running[request.id] = ((name, internal), request)
            self._ours[internal] = self._ours[name] = request.id

    def step(self, done: Done, busy: bool) -> bool:
        """One scheduling step of the running requests (none: nothing runs); each that finished to ``done``. After an
        :meth:`interrupt`, no step: every running request ends with its tokens so far (reason ``"abort"``). Runs on:
        the rollout's process."""
        if not self._running:
            return busy
        if self._interrupt.is_set():
            self._interrupt.clear()
            for completion in self.abort(list(self._running)):
                done(completion)
            return busy
        for out in vllm_compat.step(self.engine.llm):
            if not out.finished:
                continue
            ours = self._ours.get(str(out.request_id))
            if ours is None or ours not in self._running:  # aborted meanwhile
                continue
            self._forget(ours)
            samples: Any = out.outputs  # a generation request's completions (pooling requests are never added)
            ids, lps = vllm_ids_and_logprobs(samples[0].token_ids, samples[0].logprobs)
            done(Completion(ours, ids, lps, "length" if samples[0].finish_reason == "length" else "stop"))
        return busy

    def abort(self, ids: Iterable[str]) -> list[Completion]:
        """End running requests ``ids`` in vLLM; each comes back with its tokens so far. Runs on: the rollout's
        process."""
        gone = [ours for ours in ids if ours in self._running]
        internal = [self._running[ours][0][1] for ours in gone]
        ended = [
            Completion(ours, *vllm_ids_and_logprobs(*vllm_compat.sampled_so_far(self.engine.llm, name)), "abort")
            for ours, name in zip(gone, internal, strict=True)
        ]
        for ours in gone:
            self._forget(ours)
        if gone:
            vllm_compat.abort_requests(self.engine.llm, internal)
        return ended

    def _forget(self, ours: str) -> None:
        """Drop request ``ours`` and both its names."""
        names, _ = self._running.pop(ours)
        for name in names:
            self._ours.pop(name, None)

    def pending(self) -> int:
        """How many requests run. Runs on: the rollout's process."""
        return len(self._running)

    def interrupt(self) -> None:
        """End every running request at the next :meth:`step`, each with its tokens so far (see
        ``RequestQueue.interrupt``). Runs on: any thread."""
        if self._running:
            self._interrupt.set()

    def end_sessions(self, sessions: Iterable[Hashable]) -> None:
        """Nothing is kept per session (vLLM's prefix cache serves a session's next turn). Runs on: the rollout's
        process."""


class RemoteQueueHost(Protocol):
    """What :class:`ServerRequestQueue` needs of the engine server's client."""

    def step_requests(self, new: list[Request], aborts: list[str], interrupt: bool, most: int) -> list[Completion]:
        """Steps of the server's :class:`VLLMRequestQueue`: ``aborts`` ended, ``new`` queued, an interrupt
        (``interrupt``) passed on, then up to ``most`` scheduling steps (fewer when none is left running); the requests
        that ended."""
        ...


class ServerRequestQueue:
    """Requests on a vLLM engine server at TP 1 (its own :class:`VLLMRequestQueue`), one round trip per step: the step
    carries the requests added and aborted since the last one and an interrupt, runs up to ``steps_per_call``
    scheduling steps in the server, and brings back what ended (a request that ends early in a call waits for the
    call's end, as an episode's next turn then does). A round trip per scheduling step cost the streamed long-tail
    benchmark 30% of its step on a 2-core machine, 8 a call 0-4% against rounds of ``generate`` calls
    (docs/performance-log.md); a pause waits for the running call, at most ``steps_per_call`` scheduling steps. A
    request the server refuses raises at that step. Runs on: the rollout's process (the server's client)."""

    def __init__(self, host: RemoteQueueHost, *, steps_per_call: int = 8) -> None:
        self.host = host
        self.steps_per_call = steps_per_call
        self._new: list[Request] = []
        self._aborts: list[str] = []
        self._running: set[str] = set()  # added, not yet ended
        self._interrupt = threading.Event()

    def add(self, requests: Sequence[Request]) -> None:
        """Queue ``requests`` for the next :meth:`step` (their settings checked here, their prompts in the server).
        Runs on: the rollout's process."""
        for request in requests:
            request.params.check()
            self._new.append(request)
            self._running.add(request.id)

    def step(self, done: Done, busy: bool) -> bool:
        """Up to ``steps_per_call`` scheduling steps in the server (one round trip); each request that ended to
        ``done``. Runs on: the rollout's process."""
        if not self._running and not self._aborts:
            self._interrupt.clear()
            return busy
        new, self._new = self._new, []
        aborts, self._aborts = self._aborts, []
        interrupt = self._interrupt.is_set()
        self._interrupt.clear()
        for completion in self.host.step_requests(new, aborts, interrupt, self.steps_per_call):
            self._running.discard(completion.id)
            done(completion)
        return busy

    def abort(self, ids: Iterable[str]) -> list[Completion]:
        """End running requests ``ids`` at the next step (the tokens they sampled in the server are not read back).
        Runs on: the rollout's process."""
        gone = [ours for ours in ids if ours in self._running]
        for ours in gone:
            self._running.discard(ours)
            queued = [r for r in self._new if r.id == ours]
            if queued:
                self._new.remove(queued[0])
            else:
                self._aborts.append(ours)
        return [Completion(ours, [], [], "abort") for ours in gone]

    def pending(self) -> int:
        """How many requests are queued or running. Runs on: the rollout's process."""
        return len(self._running)

    def interrupt(self) -> None:
        """End every running request at the next :meth:`step`, each with its tokens so far. Runs on: any thread."""
        if self._running:
            self._interrupt.set()

    def end_sessions(self, sessions: Iterable[Hashable]) -> None:
        """Nothing is kept per session. Runs on: the rollout's process."""


def engine_ready(engine: VLLMEngine) -> VLLMEngine:
    """``engine``, refused while it is asleep or holds no weights (vLLM would queue the requests and never run them).
    Runs on: the rollout's process."""
    if engine.asleep or engine.weights_discarded:
        raise RuntimeError("VLLMRolloutEngine.requests: the engine is asleep or holds no weights.")
    return engine


def vllm_ids_and_logprobs(token_ids: Iterable[int], logprobs: Iterable[Any] | None) -> tuple[list[int], list[float]]:
    """A vLLM sample's token ids and the engine's log-prob of each, from its ``token_ids`` and ``logprobs`` (sampled
    with ``logprobs=0``: one ``{token: Logprob}`` per token). Runs on: the rollout's process."""
    ids = list(token_ids)
    steps: list[Any] = list(logprobs or [])
    return ids, [float(step[tok].logprob) for step, tok in zip(steps, ids, strict=True)]
