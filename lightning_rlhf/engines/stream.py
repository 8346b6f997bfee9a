"""A rollout pool's generation as a stream (``AsyncConfig(stream=True)`` or ``partial_rollouts=True``): the pool admits
each step's prompts and keeps generating between the controller's calls, in a thread of its own; a step takes the
oldest complete groups while the rest go on. New weights pause the stream: with partial rollouts the running requests
are interrupted and go on after the hand-off from their tokens so far, each token keeping the version of the weights
that sampled it; without, the requests in the engine finish first. Why and how: docs/placement.md, "Streamed
rollouts".
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Coroutine, Hashable
from typing import Any, cast

import torch

from lightning_rlhf.agents.context import EpisodeContext
from lightning_rlhf.agents.driver import EpisodeOutcome, RequestDriver
from lightning_rlhf.agents.rollout import EpisodeRunner, episode_rows
from lightning_rlhf.batch import Batch
from lightning_rlhf.data.vision import VISION_COLUMN
from lightning_rlhf.engines.rollout.base import RolloutEngine
from lightning_rlhf.engines.rollout.requests import Completion, Request, SamplingParams

__all__ = ["RolloutStream"]

_SAMPLE_SEED = 1_000_003


@dataclasses.dataclass
class _Group:
    """One prompt's ``n`` samples: the prompt's row (a one-row batch), its ids, the samples as they end (a completion,
    or an episode and whether it was cut)."""

    number: int
    row: Batch
    prompt: list[int]
    params: SamplingParams
    samples: list[Completion | EpisodeContext | None]
    timed_out: list[bool] = dataclasses.field(default_factory=list)
    restarts: int = 0

    @property
    def complete(self) -> bool:
        return all(s is not None for s in self.samples)

    def oldest(self) -> int:
        """The oldest version of the weights behind any of its sampled tokens (-1: none sampled)."""
        versions = [v for s in self.samples if s is not None for v in s.versions if v >= 0]
        return min(versions, default=-1)


class RolloutStream:
    """A rollout pool rank's stream of single-turn groups on ``engine`` (see the module). ``interrupt``: pauses cut the
    running requests (partial rollouts; the engine's queue must interrupt, ``EngineAbilities.interrupts``).
    ``max_staleness``: a complete group with a token more than this many versions older than the weights being
    trained is sampled again. Runs on: the ranks of a rollout pool (its methods on the worker's thread; the
    generation on the stream's own)."""

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        interrupt: bool,
        max_staleness: int,
        pad_id: int,
        timeout_s: float = 600.0,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        self.engine = engine
        self.pad_id = pad_id
        self.episodes = episodes  # multi-turn episodes with the module's environment (None: single-turn samples)
        if episodes is not None:
            episodes.context = engine.context_length
            timeout_s = episodes.cfg.episode.episode_timeout_s
        self.interrupt = interrupt
        self.max_staleness = max_staleness
        self.driver = RequestDriver(engine.requests, lockstep=False, shared=engine.tp_size > 1, timeout_s=timeout_s)
        self._groups: dict[int, _Group] = {}  # admitted, not yet taken, by admission order
        self._numbers = 0
        self._done = threading.Condition()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning-rlhf-stream", daemon=True)
        self._thread.start()
        self._started.wait()
        self.restarted = 0  # groups sampled again because they grew too stale
        self._engine_s = 0.0  # the driver's engine seconds at the last take

    # ------------------------------------------------------------------------------------------ worker's side
    def submit(self, rows: Batch, prompts: list[list[int]], params: SamplingParams) -> None:
        """Admit one group per row of ``rows`` (``prompts``: its ids; ``params``: ``n`` samples each, its seed the
        step's). Runs on: the worker's thread."""
        if self.episodes is not None:
            self.episodes.take_meta(rows)
        groups = []
        for i, prompt in enumerate(prompts):
            group = _Group(self._numbers, rows.select([i]), prompt, params, [None] * params.n, [False] * params.n)
            self._numbers += 1
            self._groups[group.number] = group
            groups.append(group)
        self._call(self._admit, *groups)  # in one callback: their requests go into the same engine step

    def take(self, count: int, *, version: int) -> tuple[Batch, dict[str, float]]:
        """The ``count`` oldest complete groups whose tokens are within ``max_staleness`` of ``version`` (the weights
        being trained), waiting for them (a group too stale is sampled again): one row per sample, the layout of
        ``sample_rollout`` plus ``rollout_versions`` (per token; -1 past the response) and ``weight_version`` (its
        oldest token's). Returns the batch and the stream's figures. Runs on: the worker's thread. Raises what the
        stream's thread raised."""
        taken: list[_Group] = []
        with self._done:
            while True:
                self._raise()
                for group in sorted(self._groups.values(), key=lambda g: g.number):
                    if len(taken) == count:
                        break
                    if not group.complete:
                        continue
                    del self._groups[group.number]
                    oldest = group.oldest()
                    if oldest >= 0 and version - oldest > self.max_staleness:  # sampled again from its prompt
                        self._restart(group)
                    else:
                        taken.append(group)
                if len(taken) == count:
                    break
                self._done.wait(timeout=1.0)
        in_flight = [g for g in self._groups.values() if not g.complete]
        engine_s, self._engine_s = self.driver.engine_s - self._engine_s, self.driver.engine_s
        figures = {
            "rollout/stream/in_flight": float(len(in_flight)),
            "rollout/stream/engine_s": engine_s,
            "rollout/stream/restarted": float(self.restarted),
            "rollout/stream/mixed_versions": _mixed(taken),
        }
        return self._rows(taken, version), figures

    def pause(self) -> None:
        """Stop generating (interrupting the running requests, with ``interrupt``) and return once the engine is idle:
        new weights may then load. Runs on: the worker's thread."""
        self._raise()
        self.driver.pause(interrupt=self.interrupt)

    def resume(self, version: int) -> None:
        """Go on generating with the weights of ``version``. Runs on: the worker's thread."""
        self.driver.resume(version)

    def close(self) -> None:
        """End the stream and its thread (its groups are dropped). Runs on: the worker's thread."""
        self.driver.close()
        self._thread.join(timeout=60)

    # ------------------------------------------------------------------------------------------ stream's side
    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as err:  # the worker's next call raises it
            with self._done:
                self._error = err
                self._done.notify_all()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        serving = self._loop.create_task(self.driver.serve())
        await asyncio.sleep(0)  # the driver's loop state is set before anyone adds to it
        self._started.set()
        try:
            await serving
        finally:
            if self.episodes is not None:  # what the episodes shared (an HTTP agent's endpoint)
                await self.episodes.resources.aclose()

    def _call(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)

    def _admit(self, *groups: _Group) -> None:
        """Start the groups' samples (in the stream's loop)."""
        for group, j in ((g, j) for g in groups for j in range(g.params.n)):
            key = f"{group.number}.{j}.{group.restarts}"
            seed = (group.params.seed + group.number * _SAMPLE_SEED + j + group.restarts * 7919) % (1 << 62)
            params = dataclasses.replace(group.params, n=1, seed=seed)
            if self.episodes is None:
                vision = (group.row.columns.get(VISION_COLUMN) or [None])[0]  # the prompt's images, if any
                request = Request(id=key, prompt=group.prompt, params=params, vision=vision)
                self.driver.add(key, self._sample(key, group, j, request))
                continue
            row = {k: v[0] for k, v in group.row.columns.items()}
            episode, coro = self.episodes.start(self.driver, key, group.number * group.params.n + j, row, params)
            outcome: list[EpisodeOutcome] = []
            outcome.append(self.driver.add(key, self._episode(group, j, episode, coro, outcome)))

    async def _episode(
        self,
        group: _Group,
        j: int,
        episode: EpisodeContext,
        coro: Coroutine[Any, Any, None],
        outcome: list[EpisodeOutcome],
    ) -> None:
        try:
            await coro
        finally:  # ended, or cut by its timeout (then cancelled here): the group holds it either way
            with self._done:
                group.samples[j] = episode
                group.timed_out[j] = bool(outcome) and outcome[0].timed_out
                self._done.notify_all()

    async def _sample(self, key: Hashable, group: _Group, j: int, request: Request) -> None:
        completion = await self.driver.request(key, request)
        with self._done:
            group.samples[j] = completion
            self._done.notify_all()

    def _restart(self, group: _Group) -> None:
        """Sample ``group`` again from its prompt (worker's thread, holding the lock)."""
        self.restarted += 1
        n = group.params.n
        again = dataclasses.replace(
            group, number=self._numbers, samples=[None] * n, timed_out=[False] * n, restarts=group.restarts + 1
        )
        self._numbers += 1
        self._groups[again.number] = again
        self._call(self._admit, again)

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"the rollout stream failed: {type(self._error).__name__}: {self._error}"
            ) from self._error

    # ------------------------------------------------------------------------------------------------- rows
    def _rows(self, groups: list[_Group], version: int) -> Batch:
        """The groups' samples as rows: each group's row repeated ``n`` times, then its responses (``version``: the
        ``weight_version`` of a sample without a sampled token, an episode cut before its first turn)."""
        if not groups:
            raise ValueError("RolloutStream.take: no groups to take")
        n = groups[0].params.n
        rows = Batch.cat([g.row.select([0] * n) for g in groups])
        if self.episodes is not None:
            episodes = [cast(EpisodeContext, s) for g in groups for s in g.samples]
            rows = episode_rows(rows, episodes, [t for g in groups for t in g.timed_out], pad_id=self.pad_id)
            width = rows["responses"].shape[1]
            rows["rollout_versions"] = _padded([ep.versions for ep in episodes], -1, width, torch.long)
            oldest = [min((v for v in ep.versions if v >= 0), default=version) for ep in episodes]
            rows["weight_version"] = torch.tensor(oldest, dtype=torch.long)
            rows.meta["group_size"] = n
            return rows
        samples = [cast(Completion, s) for g in groups for s in g.samples]
        width = max(1, max(len(s.ids) for s in samples))
        rows["responses"] = _padded([s.ids for s in samples], self.pad_id, width, torch.long)
        rows["response_mask"] = _padded([[1] * len(s.ids) for s in samples], 0, width, torch.long)
        rows["rollout_logprobs"] = _padded([s.logprobs for s in samples], 0.0, width, torch.float32)
        rows["rollout_versions"] = _padded([s.versions for s in samples], -1, width, torch.long)
        stops = set(groups[0].params.stop_token_ids)
        rows["response_truncated"] = torch.tensor([not s.ids or s.ids[-1] not in stops for s in samples])
        rows["weight_version"] = torch.tensor([min(s.versions, default=version) for s in samples], dtype=torch.long)
        rows.meta["group_size"] = n
        return rows


def _padded(rows: list[list[Any]], fill: Any, width: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def _mixed(groups: list[_Group]) -> float:
    """The fraction of samples whose tokens come from more than one version of the weights."""
    samples = [s for g in groups for s in g.samples if s is not None]
    return sum(len({v for v in s.versions if v >= 0}) > 1 for s in samples) / max(1, len(samples))
