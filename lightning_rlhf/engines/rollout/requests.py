"""Rollouts as requests: what a caller submits to a rollout engine (:class:`Request`: prompt ids, sampling, an id,
an optional session), what comes back (:class:`Completion`: ids, log-probs, why it ended), and the queue every engine
serves (:class:`RequestQueue`, ``RolloutEngine.requests``). Multi-turn episodes are written against it
(:mod:`lightning_rlhf.agents.driver`); single-turn rollouts keep calling ``generate``.

:class:`BatchedRequestQueue` serves requests through an engine's ``generate``: each step is one round of calls over
everything queued, requests grouped by their sampling settings and the model's context, the samples of one prompt
(a GRPO group's first turn) drawn with ``n`` in one prompt. Engines that decode continuously (vLLM at TP 1) or keep
each session's keys and values (the transformers engine) have queues of their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Literal, Protocol

from lightning_rlhf.config import check_sampling
from lightning_rlhf.data.vision import VisionInputs

__all__ = [
    "BatchedRequestQueue",
    "Completion",
    "Done",
    "Generator",
    "Request",
    "RequestQueue",
    "RolloutOutput",
    "SamplingParams",
    "completion_of",
    "shared_prompts",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Sampling settings of one generate call (checked by :func:`check_sampling` in every engine). ``temperature=0``
    or ``greedy=True`` decode greedily: every one of the ``n`` samples of a prompt is the same response."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    greedy: bool = False

    @property
    def is_greedy(self) -> bool:
        """Greedy decoding: ``greedy=True`` or ``temperature=0``."""
        return self.greedy or self.temperature == 0

    @property
    def sampling_temperature(self) -> float:
        """The temperature the engine uses: 0 for greedy decoding."""
        return 0.0 if self.is_greedy else self.temperature

    def check(self) -> None:
        """:func:`check_sampling` on these settings. Runs on: worker (each engine, before generating)."""
        check_sampling(
            temperature=self.sampling_temperature, top_p=self.top_p, top_k=self.top_k, owner=type(self).__name__
        )


@dataclasses.dataclass
class RolloutOutput:
    """Responses of one generate call, ``n`` consecutive samples per prompt: ``responses[i]`` holds the generated token
    ids up to and including the first stop token, or ``max_new_tokens`` ids if none came; ``logprobs[i]`` the engine's
    log-probabilities of those tokens under the distribution it sampled from (:func:`processed_logprobs`)."""

    responses: list[list[int]]
    logprobs: list[list[float]] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """One sample to draw: ``prompt`` (token ids, no padding) continued under ``params`` (``n`` is 1; its
    ``max_new_tokens`` is this request's own bound, its ``seed`` this request's draws). ``session``: the episode the
    request belongs to (an engine that keeps keys and values between turns keeps them under it until
    :meth:`RequestQueue.end_sessions`). ``vision``: the images the prompt's placeholders stand for, in order (a
    vision-language episode's prompt images and observations'; None: text)."""

    id: str
    prompt: list[int]
    params: SamplingParams
    session: Hashable | None = None
    vision: VisionInputs | None = None


@dataclasses.dataclass(frozen=True)
class Completion:
    """What a request sampled: ``ids`` (up to and including the stop token that ended it), their ``logprobs`` under the
    distribution sampled from, and ``reason``: ``"stop"`` (a stop token or the end of sequence), ``"length"`` (its
    ``max_new_tokens``), ``"abort"`` (aborted or interrupted: the ids so far)."""

    id: str
    ids: list[int]
    logprobs: list[float]
    reason: Literal["stop", "length", "abort"]
    versions: list[int] = dataclasses.field(default_factory=list)
    """Per token, the version of the weights that sampled it (stamped by the episodes' driver; empty from a queue)."""


Done = Callable[[Completion], None]
"""Called once per request that ends, as soon as it ends (possibly while the step still decodes others)."""


class RequestQueue(Protocol):
    """The requests an engine serves. Runs on: the rollout's process, all calls from one thread (the driver's engine
    thread); at TP > 1 the ranks of the engine's group call :meth:`step` together."""

    def add(self, requests: Sequence[Request]) -> None:
        """Queue ``requests``; they start at the next :meth:`step` (or join the running ones, for an engine that
        decodes continuously). Raises ``ValueError`` for a request the engine cannot serve (its prompt plus its
        ``max_new_tokens`` past the model's context, a token outside the vocabulary)."""
        ...

    def step(self, done: Done, busy: bool) -> bool:
        """Run the queued requests one step: a round of ``generate`` calls, or one scheduling step of an engine that
        decodes continuously; each request that ends goes to ``done``. ``busy``: this rank still has work (requests or
        episodes); at TP > 1 the ranks of the group agree on the round and the return is whether any of them is still
        busy (at TP 1: ``busy``)."""
        ...

    def abort(self, ids: Iterable[str]) -> list[Completion]:
        """End the requests ``ids`` (queued or running) without their completion going to ``done``: what each had
        sampled so far, reason ``"abort"`` (unknown or finished ids are skipped)."""
        ...

    def pending(self) -> int:
        """How many requests are queued or running."""
        ...

    def interrupt(self) -> None:
        """Thread-safe: end the running step at its next decoding step, each request still running completing with
        reason ``"abort"`` and the tokens it has so far (a queue whose engine cannot, ``EngineAbilities.interrupts``
        False, lets the step run to its end)."""
        ...

    def end_sessions(self, sessions: Iterable[Hashable]) -> None:
        """Drop what the engine keeps of ``sessions`` (their keys and values): their episodes ended."""
        ...


def completion_of(request: Request, ids: Sequence[int], logprobs: Sequence[float] | None) -> Completion:
    """``request``'s completion from a response of a ``generate`` call sampled with at least its bound: cut to its own
    ``max_new_tokens``, reason ``"stop"`` where it ended before the bound or on one of its stop tokens. Runs on: the
    rollout's process."""
    bound = request.params.max_new_tokens
    kept = list(ids[:bound])
    lps = list(logprobs or [])[: len(kept)]
    lps += [0.0] * (len(kept) - len(lps))
    ended = len(ids) < bound or (bool(kept) and kept[-1] in request.params.stop_token_ids)
    return Completion(request.id, kept, lps, "stop" if ended else "length")


def shared_prompts(requests: Sequence[Request]) -> tuple[list[Request], int]:
    """``(requests in call order, copies)``: where the requests are ``copies`` requests each of the same prompt (a GRPO
    group's first turn), one call samples ``copies`` responses per distinct prompt, so the engine reads each prompt
    once; the requests are then ordered prompt by prompt. Else ``(requests, 1)`` (greedy decoding: one each). Runs on:
    the rollout's process."""
    if len(requests) < 2 or requests[0].params.is_greedy:
        return list(requests), 1
    same: dict[tuple[int, ...], list[Request]] = {}
    for request in requests:  # the same prompt (and images) and the same bound
        images = -1 if request.vision is None else id(request.vision)
        same.setdefault((request.params.max_new_tokens, images, *request.prompt), []).append(request)
    sizes = {len(members) for members in same.values()}
    if len(sizes) != 1 or sizes == {1}:
        return list(requests), 1
    return [r for members in same.values() for r in members], sizes.pop()


def _settings(params: SamplingParams) -> SamplingParams:
    """What requests must share to go in one call: everything but the seed and the bound."""
    return dataclasses.replace(params, n=1, seed=0, max_new_tokens=1)


class Generator(Protocol):
    """What :class:`BatchedRequestQueue` needs of an engine (every ``RolloutEngine`` has it)."""

    @property
    def tp_size(self) -> int:
        """Ranks per tensor-parallel engine."""
        ...

    @property
    def context_length(self) -> int | None:
        """The most tokens a prompt and its response may hold together (None: unbounded)."""
        ...

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, vision: Sequence[VisionInputs | None] | None = None
    ) -> RolloutOutput:
        """Sample ``params.n`` responses per prompt (``vision``: each prompt's images)."""
        ...

    def agree(self, calls: int, busy: bool) -> tuple[int, bool]:
        """The TP group's round: the most calls any rank makes, and whether any is busy."""
        ...


class BatchedRequestQueue:
    """Requests served by ``engine.generate``: each :meth:`step` takes everything queued and makes one call per group of
    requests with the same sampling settings whose longest prompt plus largest bound fits the model's context
    (``engine.context_length``; usually one call), each response cut to its request's own bound. At TP > 1 the ranks
    agree on the number of calls first (``engine.agree``); a rank with fewer makes the rest without prompts. Serves
    the vLLM engine at TP > 1, the vLLM engine server, and engines of one's own. Runs on: the rollout's process."""

    def __init__(self, engine: Generator) -> None:
        self.engine = engine
        self._queued: list[Request] = []

    def add(self, requests: Sequence[Request]) -> None:
        """Queue ``requests`` for the next :meth:`step`. Runs on: the rollout's process."""
        self._queued.extend(requests)

    def pending(self) -> int:
        """How many requests wait for the next :meth:`step`. Runs on: the rollout's process."""
        return len(self._queued)

    def abort(self, ids: Iterable[str]) -> list[Completion]:
        """Drop queued requests ``ids`` (a step's calls run to their end). Runs on: the rollout's process."""
        drop = set(ids)
        gone = [r for r in self._queued if r.id in drop]
        self._queued = [r for r in self._queued if r.id not in drop]
        return [Completion(r.id, [], [], "abort") for r in gone]

    def end_sessions(self, sessions: Iterable[Hashable]) -> None:
        """Nothing is kept between calls. Runs on: the rollout's process."""

    def interrupt(self) -> None:
        """A ``generate`` call cannot be interrupted: the step runs to its end. Runs on: any thread."""

    def step(self, done: Done, busy: bool) -> bool:
        """One round of calls over everything queued (see the class). Runs on: the rollout's process (at TP > 1 every
        rank of the group)."""
        requests, self._queued = self._queued, []
        calls = self.calls(requests)
        rounds, busy = len(calls), busy or bool(requests)
        if self.engine.tp_size > 1:
            rounds, busy = self.engine.agree(rounds, busy)
        for k in range(rounds):
            if k >= len(calls):  # the other ranks' calls of this round
                self.engine.generate([], SamplingParams(max_new_tokens=1))
                continue
            group, params = calls[k]
            self.serve(group, params, done)
        return busy

    def calls(self, requests: Sequence[Request]) -> list[tuple[list[Request], SamplingParams]]:
        """``requests`` as calls: ``(the call's requests, its settings)``, grouped by settings, then so that each call's
        longest prompt plus its largest bound fits the context. Runs on: the rollout's process."""
        by_settings: dict[SamplingParams, list[Request]] = {}
        for request in requests:
            by_settings.setdefault(_settings(request.params), []).append(request)
        context = self.engine.context_length
        calls = []
        for members in by_settings.values():
            groups: list[list[Request]] = []
            tops: list[int] = []
            for request in sorted(members, key=lambda r: -r.params.max_new_tokens):
                for group, top in zip(groups, tops, strict=True):
                    if context is None or len(request.prompt) + top <= context:
                        group.append(request)
                        break
                else:
                    groups.append([request])
                    tops.append(request.params.max_new_tokens)
            order = {id(r): i for i, r in enumerate(members)}
            for group, top in zip(groups, tops, strict=True):
                group.sort(key=lambda r: order[id(r)])
                calls.append((group, dataclasses.replace(group[0].params, max_new_tokens=top)))
        return calls

    def serve(self, group: list[Request], params: SamplingParams, done: Done) -> None:
        """One ``generate`` call for ``group`` (the samples of one prompt together), each completion to ``done``."""
        group, copies = shared_prompts(group)
        heads = group[::copies]
        images = [r.vision for r in heads]
        out: RolloutOutput = self.engine.generate(
            [r.prompt for r in heads],
            dataclasses.replace(params, n=copies),
            *([images] if any(v is not None for v in images) else []),  # an engine of one's own may take text only
        )
        logprobs = out.logprobs or [[] for _ in out.responses]
        for request, ids, lps in zip(group, out.responses, logprobs, strict=True):
            done(completion_of(request, ids, lps))
