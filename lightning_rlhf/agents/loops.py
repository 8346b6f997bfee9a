"""Agent loops: how an episode goes from turn to turn. A loop is a coroutine ``run(episode)`` over an
:class:`~lightning_rlhf.agents.context.EpisodeContext` (sample a turn, run tools, append an observation); the
library handles the tokens, the masks and the engine. ``EpisodeConfig.agent_loop`` names the loop a run uses; the
default is :class:`ToolLoop`. A loop of one's own: :func:`register_agent_loop` (docs/agents.md, "Your own loop").
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from lightning_rlhf.agents.context import EpisodeContext

__all__ = ["AgentLoop", "ToolLoop", "agent_loop", "agent_loop_names", "register_agent_loop"]


@runtime_checkable
class AgentLoop(Protocol):
    """An episode's turns: ``await run(episode)`` runs one episode to its end and returns None. One instance per
    rollout's runner serves every episode (keep per-episode state in locals). Runs on: the rollout's process."""

    async def run(self, episode: EpisodeContext) -> None:
        """Run ``episode`` to its end."""
        ...


_LOOPS: dict[str, Callable[[], AgentLoop]] = {}
L = TypeVar("L")


def register_agent_loop(name: str) -> Callable[[L], L]:
    """A decorator that registers an agent loop under ``name`` (``EpisodeConfig(agent_loop=name)``): a class with
    ``async def run(self, episode)`` (made once per rollout runner, without arguments), or an ``async def`` function of
    the episode. Runs on: every process that imports the module defining it (before the module is built). Raises
    ``ValueError`` for a name taken by another loop, or an object that is neither."""

    def register(loop: L) -> L:
        if inspect.isclass(loop):
            if not inspect.iscoroutinefunction(getattr(loop, "run", None)):
                raise ValueError(
                    f"register_agent_loop({name!r}): {loop.__name__}.run is not an `async def` method. HINT: define "
                    "`async def run(self, episode)` (its turns: `await episode.generate()` ...)."
                )
            make: Callable[[], AgentLoop] = loop  # type: ignore[assignment]
        elif inspect.iscoroutinefunction(loop):
            make = _FunctionLoop.of(loop)
        else:
            raise ValueError(
                f"register_agent_loop({name!r}): {loop!r:.100} is neither a class with `async def run(self, episode)` "
                "nor an `async def` function of the episode."
            )
        known = _LOOPS.get(name)
        if known is not None and _identity(known) != _identity(make):  # the same definition imported again is fine
            raise ValueError(
                f"register_agent_loop({name!r}): the name is taken by {_qualname(known)}. HINT: choose another name."
            )
        _LOOPS[name] = make
        return loop

    return register


def agent_loop_names() -> list[str]:
    """The registered agent loops' names. Runs on: any process."""
    return sorted(_LOOPS)


def agent_loop(name: str) -> AgentLoop:
    """A new instance of the agent loop registered as ``name``. Runs on: the rollout's process (and every process at
    module build, to check the setting). Raises ``ValueError`` naming the registered loops."""
    if name not in _LOOPS:
        raise ValueError(
            f"EpisodeConfig(agent_loop={name!r}) names no registered agent loop; registered: {agent_loop_names()}. "
            "HINT: decorate your loop with @lightning_rlhf.agents.register_agent_loop(name) in a module the run "
            "imports (the module defining your environment or reward)."
        )
    return _LOOPS[name]()


def _qualname(make: Any) -> str:
    fn = getattr(make, "fn", make)
    return f"{fn.__module__}.{fn.__qualname__}"


def _identity(make: Any) -> tuple[str, str]:
    """A loop's definition: its qualified name in its source file (a module imported under two names, as a script's
    ``__main__`` and by its path, defines the same loop twice)."""
    fn = getattr(make, "fn", make)
    try:
        where = os.path.realpath(inspect.getfile(fn))
    except TypeError:  # defined where no file is known (a REPL)
        where = fn.__module__
    return fn.__qualname__, where


class _FunctionLoop:
    """An ``async def`` function of the episode as an :class:`AgentLoop`."""

    fn: Callable[[EpisodeContext], Any]

    @classmethod
    def of(cls, fn: Callable[[EpisodeContext], Any]) -> Callable[[], AgentLoop]:
        def make() -> AgentLoop:
            loop = cls()
            loop.fn = fn
            return loop

        make.fn = fn  # type: ignore[attr-defined]
        return make

    async def run(self, episode: EpisodeContext) -> None:
        return await self.fn(episode)  # type: ignore[no-any-return]


@register_agent_loop("tools")
class ToolLoop:
    """The default loop: the model's turn; the environment's answer (``env.step``) or, where it leaves the turn to the
    tools, the turn's tool calls run; the observation appended; until the model answers without calling a tool, the
    environment says the episode is done, or a limit ends it (``max_turns``, ``max_episode_tokens``, the model's
    context: truncated). Runs on: the rollout's process."""

    async def run(self, episode: EpisodeContext) -> None:
        """Run ``episode`` to its end."""
        while True:
            turn = await episode.generate()
            if turn.truncated:
                return
            answered = episode.env_step(turn)
            if answered is None:
                calls = episode.tool_calls(turn)
                if not calls:  # the model answered
                    return
                if episode.last_turn:  # its observation would never be answered
                    episode.truncate()
                    return
                messages = await episode.call_tools(calls)
            else:
                messages, done = answered
                if done:
                    return
                if episode.last_turn:
                    episode.truncate()
                    return
            if not episode.observe(messages):
                return
