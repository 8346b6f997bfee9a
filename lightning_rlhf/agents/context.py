"""One episode while it runs, as an agent loop sees it (:class:`EpisodeContext`): its environment, its conversation
and its tokens. Token in, token out: the episode's ids are its prompt's, then each turn's ids as the engine sampled
them (:meth:`EpisodeContext.generate`), then each observation's ids (:meth:`EpisodeContext.observe`, rendered by the
chat template's delta); the conversation is never tokenized again from text. Limits: docs/agents.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import dataclasses
import math
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Protocol

from lightning_rlhf.agents.driver import RequestDriver
from lightning_rlhf.agents.env import Environment, Episode, Message
from lightning_rlhf.agents.parsing import ParsedTurn, ToolCall, parse_with_template
from lightning_rlhf.agents.tokens import ChatDelta
from lightning_rlhf.agents.tools import ToolSet
from lightning_rlhf.config import RolloutConfig
from lightning_rlhf.data.vision import ChatImages, VisionInputs, join_vision
from lightning_rlhf.engines.rollout.requests import Request, SamplingParams
from lightning_rlhf.sandbox.tools import ToolExecutor, ToolResult

__all__ = ["TOOL_ERROR_KINDS", "EpisodeContext", "EpisodeHost", "RolloutResources", "Turn"]

TOOL_ERROR_KINDS = ("malformed", "raised", "timeout", "crash", "invalid_result")
"""How a tool call can fail (each kind explained in docs/agents.md, "What you see")."""

_PREFIX_IDS = 32
"""Ids before a turn handed to a ``response_template`` parser: its generation prompt (what the template may have
written of the reply already, such as an opening think tag) with room to spare."""

_TURN_SEED = 15_485_863  # primes: the seeds of an episode's turns and of the episodes never meet
_EPISODE_SEED = 1_000_003


class RolloutResources:
    """What a rollout's episodes share, made by the first that asks and closed (``aclose()``) when the rollout ends: an
    HTTP agent's endpoint. Runs on: the rollout's process (its event loop)."""

    def __init__(self) -> None:
        self._made: dict[str, Any] = {}
        self._making: dict[str, asyncio.Future[Any]] = {}

    async def get(self, key: str, make: Callable[[], Awaitable[Any]]) -> Any:
        """The resource ``key``, made by ``await make()`` the first time (the others wait for it)."""
        if key in self._made:
            return self._made[key]
        if key not in self._making:
            self._making[key] = asyncio.ensure_future(make())
        made = await asyncio.shield(self._making[key])
        self._made[key] = made
        return made

    async def aclose(self) -> None:
        """Close every resource made (``await resource.aclose()``), newest first."""
        made, self._made, self._making = self._made, {}, {}
        for resource in reversed(list(made.values())):
            await resource.aclose()


class EpisodeHost(Protocol):
    """What an episode needs of the rank's rollout (:class:`~lightning_rlhf.agents.rollout.EpisodeRunner`): the
    settings, the tokenizer, the tool format, the limits, and where tools run."""

    cfg: RolloutConfig
    tokenizer: Any
    parse: Callable[[str], ParsedTurn] | None
    """The tool-call parser (None: the tokenizer's ``response_template``)."""
    budget: int
    """Tokens an episode may hold after its prompt."""
    context: int | None
    """The engine's context length (None: unbounded)."""
    resources: RolloutResources
    """What the rollout's episodes share (closed when it ends)."""
    chat_template_kwargs: dict[str, Any]
    """The data module's extra chat template arguments."""
    model_name: str
    """The name agents over HTTP ask for (the actor's path)."""
    images: ChatImages
    """Images in the messages: decoded, their placeholders expanded."""

    def executor_of(self, env: Environment) -> ToolExecutor | None:
        """The tool workers of ``env``'s tools (None: none, or in this process)."""
        ...

    def in_thread(self, fn: Callable[..., Any], call: ToolCall) -> cf.Future[ToolResult]:
        """A stateful tool in a thread of this process, with the timeout."""
        ...


@dataclasses.dataclass(frozen=True)
class Turn:
    """An assistant turn as sampled: its ``ids`` and their ``logprobs`` (the engine's), its ``text`` (decoded without
    special tokens), the chat ``message`` appended to the episode, and ``truncated``: the turn was cut by its token
    limit (the episode's room or ``max_new_tokens``) rather than ended by the model; the episode is then over."""

    ids: list[int]
    logprobs: list[float]
    text: str
    message: Message
    truncated: bool


class EpisodeContext:
    """One episode of a rollout: what an agent loop's ``run(episode)`` gets. ``env`` is the episode's environment,
    ``info`` the :class:`~lightning_rlhf.agents.env.Episode` its reward function reads (``messages``, ``turns``,
    ``truncated`` ...), ``prompt`` the first prompt's ids, ``ids`` what followed (sampled turns and observations),
    ``sampled`` 1 for each sampled id and 0 for each observation id, ``vision`` the images so far (``reset``'s, then
    each observation's, in order; None: none). Made by the rollout's
    :class:`~lightning_rlhf.agents.rollout.EpisodeRunner`. Runs on: the rollout's process (an episode's coroutine).
    """

    def __init__(
        self,
        runner: EpisodeHost,
        driver: RequestDriver,
        key: Hashable,
        number: int,
        env: Environment,
        info: Episode,
        tools: ToolSet,
        delta: ChatDelta,
        prompt: list[int],
        params: SamplingParams,
        opening: str,
        vision: VisionInputs | None = None,
    ) -> None:
        self.runner, self.driver, self.key, self.number = runner, driver, key, number
        self.env, self.info, self.tools, self.delta = env, info, tools, delta
        self.prompt = prompt
        self.params = params
        self.opening = opening  # the last user message of reset's messages
        self.vision = vision
        self.ids: list[int] = []
        self.versions: list[int] = []  # per id: the weights' version that sampled it (-1: an observation)
        self.sampled: list[int] = []
        self.logprobs: list[float] = []
        self.last_id: int | None = None
        self.tool_s = 0.0
        self.observation_tokens = 0
        self.errors: dict[str, int] = {}  # tool errors by kind (TOOL_ERROR_KINDS)
        self.problems: dict[str, str] = {}  # the first message of each kind of problem
        self.stops = set(params.stop_token_ids)

    # ---------------------------------------------------------------------------------------------- limits
    @property
    def room(self) -> int:
        """The tokens the episode has left: of its budget (``max_episode_tokens``), and of the model's context."""
        left = self.runner.budget - len(self.ids)
        context = self.runner.context
        return left if context is None else min(left, context - len(self.prompt) - len(self.ids))

    @property
    def last_turn(self) -> bool:
        """Whether the episode has had its ``max_turns`` turns (an observation now would never be answered)."""
        return self.info.turns >= self.runner.cfg.episode.max_turns

    def truncate(self) -> None:
        """End the episode as truncated (its reward functions see ``episode.truncated``)."""
        self.info.truncated = True

    def problem(self, kind: str, text: str) -> None:
        """Count a problem of ``kind`` (a tool error or an overflow), keeping the first one's words."""
        if kind in TOOL_ERROR_KINDS:
            self.errors[kind] = self.errors.get(kind, 0) + 1
            self.info.tool_errors += 1
        self.problems.setdefault(kind, text)

    # ------------------------------------------------------------------------------------------- the turns
    async def generate(self) -> Turn:
        """Sample the assistant's next turn from the conversation so far (prompt and ids), bounded by
        ``max_new_tokens`` and the episode's room; its ids, log-probs and message are appended to the episode."""
        limit = min(self.runner.cfg.max_new_tokens, self.room)
        seed = (self.params.seed + self.number * _EPISODE_SEED + self.info.turns * _TURN_SEED) % (1 << 62)
        params = dataclasses.replace(self.params, n=1, max_new_tokens=limit, seed=seed)
        request = Request(
            id=f"{self.key}/{self.info.turns}",
            prompt=self.prompt + self.ids,
            params=params,
            session=self.key,
            vision=self.vision,
        )
        done = await self.driver.request(self.key, request)
        turn = done.ids[:limit]
        logprobs = list(done.logprobs[: len(turn)]) + [0.0] * (len(turn) - len(done.logprobs))
        self.ids += turn
        self.versions += list(done.versions[: len(turn)]) or [self.driver.version] * len(turn)
        self.sampled += [1] * len(turn)
        self.logprobs += logprobs
        self.last_id = turn[-1] if turn else None
        self.info.turns += 1
        text = self.runner.tokenizer.decode(turn, skip_special_tokens=True)
        message: Message = {"role": "assistant", "content": text}
        self.info.messages.append(message)
        truncated = not turn or turn[-1] not in self.stops  # cut by the turn's (or the episode's) token limit
        # a sampled image placeholder (a stop id of a vision-language model) ends the episode: an image observed after
        # it would be taken for the placeholder's (the trainer counts a row's image tokens in order)
        if truncated or turn[-1] == self.runner.images.placeholder_id:
            self.truncate()
        return Turn(turn, logprobs, text, message, truncated)

    def tool_calls(self, turn: Turn) -> list[ToolCall]:
        """The tool calls ``turn`` makes, read in the episode's tool format (``EpisodeConfig.tool_parser``); counted in
        the episode's ``tool_calls``."""
        if self.runner.parse is None:  # the tokenizer's response_template
            end = len(self.ids) - len(turn.ids)  # the ids before the turn: its generation prompt and a little more
            before = (self.prompt[-_PREFIX_IDS:] + self.ids[max(0, end - _PREFIX_IDS) : end])[-_PREFIX_IDS:]
            calls = parse_with_template(self.runner.tokenizer, turn.ids, before, self.tools.schemas).calls
        else:
            calls = self.runner.parse(turn.text).calls
        self.info.tool_calls += len(calls)
        return list(calls)

    async def call_tools(self, calls: list[ToolCall]) -> list[Message]:
        """Run ``calls`` (in the tool workers, or in this process for a stateful environment's methods), each bounded
        by ``tool_timeout_s``, while the engine goes on with the other episodes; returns one ``tool`` message per
        call. A malformed call, a raising, hung or crashed tool becomes an error message (counted by kind)."""
        executor = self.runner.executor_of(self.env)
        answers: list[Any] = []
        for call in calls:
            problem = self.tools.check(call)
            if problem is not None:
                self.problem("malformed", f"{call.raw!r:.200}: {problem}")
                answers.append(f"error: {problem}")
            elif executor is None:  # stateful tools of a TRL-style environment: in this process
                answers.append(self.runner.in_thread(self.tools.functions[call.name], call))
            else:
                answers.append(executor.submit(call))
        futures = [asyncio.wrap_future(a) for a in answers if isinstance(a, cf.Future)]
        if futures:
            await self.driver.wait(self.key, asyncio.gather(*futures), "tools")
        messages: list[Message] = []
        for call, answer in zip(calls, answers, strict=True):
            if isinstance(answer, cf.Future):
                result = answer.result()
                self.tool_s += result.seconds
                if result.kind != "ok":
                    self.problem(result.kind, result.text)
                answer = result.text
                if result.images:  # an in-process tool's images: image items, then its text
                    items = [{"type": "image", "image": image} for image in result.images]
                    answer = [*items, *([{"type": "text", "text": answer}] if answer else [])]
            messages.append({"role": "tool", "name": call.name or "error", "content": answer})
        return messages

    def env_step(self, turn: Turn) -> tuple[list[Message], bool] | None:
        """The environment's answer to ``turn`` (``env.step``): ``(its messages, done)``, its turn reward recorded; or
        None where it leaves the turn to the tools."""
        answered = self.env.step(turn.message)
        if answered is None:
            return None
        observation, done, reward = _step_answer(answered, self.env)
        if reward is not None:
            self.info.turn_rewards.append(reward)
        return ([] if done else _messages(observation, self.env)), done

    def observe(self, messages: list[Message]) -> bool:
        """Append ``messages`` (tool results, the environment's turns) as the observation's ids; False (the episode
        ends truncated, the overflow counted) where they do not fit the room left with one more sampled token. Their
        image items (``{"type": "image", "image": ...}``) join the episode's images, each placeholder repeated per
        merged patch; the episode's messages keep bare ``{"type": "image"}`` items."""
        where = f"the observation of episode {self.key} (turn {self.info.turns})"
        messages, images = self.runner.images.split(messages, where=where)
        obs = self.delta.observation_ids(messages, last_id=self.last_id)
        seen = None
        if images:
            obs, seen = self.runner.images.expand(obs, images, where=where)
        room = self.room
        if len(obs) + 1 > room:
            self.truncate()
            longest = max((len(str(m.get("content", ""))) for m in messages), default=0)
            chars = self.runner.cfg.episode.max_tool_response_chars
            self.problem(
                "observation_overflow",
                f"an observation of {len(obs)} tokens (its longest message {longest} characters, tool results cut at "
                f"RolloutConfig(max_tool_response_chars={chars})) did not fit the {max(room - 1, 0)} tokens the "
                "episode had left",
            )
            return False
        self.ids += obs
        self.versions += [-1] * len(obs)
        self.sampled += [0] * len(obs)
        self.logprobs += [0.0] * len(obs)
        self.observation_tokens += len(obs)
        self.info.messages += messages
        if seen is not None:
            self.vision = join_vision(self.vision, seen)
        return True

    async def wait(self, awaitable: Any) -> Any:
        """Await something of the loop's own (an HTTP call, a sleep) while the engine goes on with the other episodes
        (awaited directly, it holds the engine until the episode's next turn or tool call). Bounded by
        ``EpisodeConfig.episode_timeout_s``."""
        return await self.driver.wait(self.key, awaitable, "other")


def _step_answer(answered: Any, env: Environment) -> tuple[Any, bool, float | None]:
    """``step``'s answer as ``(observation, done, turn reward or None)``."""
    if not isinstance(answered, tuple) or len(answered) not in (2, 3):
        raise ValueError(
            f"{type(env).__name__}.step returned {answered!r:.200}; expected (messages, done), (messages, done, "
            "reward) or None. HINT: return ([], True) to end the episode, None to run the turn's tool calls."
        )
    observation, done, reward = (*answered, None)[:3]
    if reward is None:
        return observation, bool(done), None
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ValueError(
            f"{type(env).__name__}.step returned the turn reward {reward!r}; expected a finite number or None. "
            "HINT: return (messages, done, float(reward))."
        )
    return observation, bool(done), float(reward)


def _messages(observation: Any, env: Environment) -> list[Message]:
    if not isinstance(observation, list) or not all(isinstance(m, dict) and "role" in m for m in observation):
        raise ValueError(
            f"{type(env).__name__}.step returned {observation!r} as its observation; expected a list of chat messages "
            "({'role': 'user' or 'tool', 'content': ...}). HINT: return (messages, done), or None to run the tool "
            "calls."
        )
    return [dict(m) for m in observation]
