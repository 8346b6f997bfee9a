"""Multi-turn episodes: every episode of a rank's rollout is one coroutine, an agent loop's ``run(episode)``
(:mod:`lightning_rlhf.agents.loops`; the default, :class:`~lightning_rlhf.agents.loops.ToolLoop`, samples a turn, runs
its tool calls in tool workers and appends the observation), driven against the engine's requests
(:class:`~lightning_rlhf.agents.driver.RequestDriver`): an episode goes on as soon as its observation is ready, while
the engine decodes the others. An episode never ends on an observation: the reward's last token is a sampled one.
Limits, scheduling and the columns written: docs/agents.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import dataclasses
import inspect
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Coroutine, Hashable, Sequence
from typing import Any, cast

import torch

from lightning_rlhf.agents.context import TOOL_ERROR_KINDS, EpisodeContext, RolloutResources
from lightning_rlhf.agents.driver import AgentLoopError, EpisodeOutcome, RequestDriver
from lightning_rlhf.agents.env import Environment, EnvironmentChoice, Episode, Message, scores_episodes
from lightning_rlhf.agents.loops import ToolLoop, agent_loop
from lightning_rlhf.agents.parsing import ToolCall, get_tool_parser, resolve_tool_parser
from lightning_rlhf.agents.tokens import ChatDelta, check_chat_template, render_chat
from lightning_rlhf.agents.tools import ToolSet
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import RolloutConfig
from lightning_rlhf.data.vision import VISION_COLUMN, ChatImages, VisionInputs, tool_images
from lightning_rlhf.engines.rollout.base import RolloutEngine, SamplingParams
from lightning_rlhf.sandbox.tools import ToolExecutor, ToolResult, tool_result

__all__ = [
    "PROBLEM_KINDS",
    "EpisodeRunner",
    "check_environment",
    "episode_metrics",
    "episode_prompt_ids",
    "episode_rows",
    "sample_episodes",
]

log = logging.getLogger(__name__)

PROBLEM_KINDS = (*TOOL_ERROR_KINDS, "observation_overflow", "episode_timeout", "agent_failed", "http_diverged")
"""The kinds of problem an episode reports: the tool errors, ``observation_overflow`` (an observation did not fit the
room the episode had left, so it ended truncated), ``episode_timeout`` (its loop ran past
``EpisodeConfig.episode_timeout_s``), and for agents over HTTP ``agent_failed`` (the program exited with an error) and
``http_diverged`` (a request's conversation was not the session's)."""


class EpisodeRunner:
    """What one rank needs to run episodes for an environment: the tool executors, the chat deltas, the parser.
    Made once per role and kept across steps (its tool workers live as long as it does). ``make_env``: what
    :func:`~lightning_rlhf.agents.env.environment_factory` makes.

    Runs on: the process that runs the rollout (a worker rank with a rollout engine).
    """

    def __init__(
        self, make_env: Callable[[], Environment], tokenizer: Any, cfg: RolloutConfig, *, model_name: str = "policy"
    ) -> None:
        self.make_env = make_env
        self.model_name = model_name  # what agents over HTTP ask for (the actor's path)
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.loop = agent_loop(cfg.episode.agent_loop)
        self.context: int | None = None  # the engine's context length, during a rollout
        self.budget = cfg.episode.max_episode_tokens or cfg.max_new_tokens * cfg.episode.max_turns  # after the prompt
        self.tool_format = resolve_tool_parser(cfg.episode.tool_parser, tokenizer)  # "auto" resolved
        self.parse = None if self.tool_format == "template" else get_tool_parser(self.tool_format)
        self._toolsets: dict[tuple[Any, ...], tuple[ToolSet, ChatDelta, ToolExecutor | None]] = {}
        # The data module's chat_template_kwargs and max_prompt_length (None: no bound), set per rollout.
        self.chat_template_kwargs: dict[str, Any] = {}
        self.max_prompt_length: int | None = None
        self._rollouts = itertools.count()
        self.resources = RolloutResources()  # what a rollout's episodes share (an HTTP agent's endpoint)
        self.images = ChatImages(tokenizer, model_name)  # images in the messages (its processor loads at the first)
        self._threads = cf.ThreadPoolExecutor(max(1, cfg.episode.tool_workers), thread_name_prefix="lightning-rlhf-env")

    def close(self) -> None:
        """End the tool workers and threads. Idempotent. Runs on: the rollout's process, at teardown."""
        for _, _, executor in self._toolsets.values():
            if executor is not None:
                executor.close()
        self._toolsets.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def take_meta(self, batch: Batch) -> None:
        """The data module's chat template arguments and prompt bound, from ``batch``'s meta, for the episodes started
        next. Runs on: the rollout's process."""
        self.chat_template_kwargs = dict(batch.meta.get("chat_template_kwargs") or {})
        self.max_prompt_length = batch.meta.get("max_prompt_length")

    def start(
        self, driver: RequestDriver, key: str, number: int, row: dict[str, Any], params: SamplingParams
    ) -> tuple[EpisodeContext, Coroutine[Any, Any, None]]:
        """Episode ``key`` of ``row`` on ``driver`` and the coroutine that runs it with the agent loop (a stream adds it
        to its driver). Runs on: the rollout's process."""
        episode = self._start(driver, key, number, row, params)
        return episode, self._run_one(episode)

    def executor_of(self, env: Environment) -> ToolExecutor | None:
        """The tool workers of ``env``'s tools (None: it has none, or they run in this process). Runs on: the
        rollout's process."""
        return self._tools_of(env)[2]

    def _tools_of(self, env: Environment) -> tuple[ToolSet, ChatDelta, ToolExecutor | None]:
        """The environment's tools, its chat delta (with the tools' schemas) and executor, made once per set of
        tool functions (an environment class's instances share theirs)."""
        in_process = getattr(env, "in_process", False)
        kwargs = repr(sorted(self.chat_template_kwargs.items()))
        key = (*(id(getattr(t, "__func__", t)) for t in env.tools), in_process, kwargs)
        if key not in self._toolsets:
            tools, delta = _tools_and_delta(env, self.tokenizer, self.chat_template_kwargs)
            executor = None
            if len(tools) and not in_process:
                executor = ToolExecutor(
                    tools.functions,
                    timeout_s=self.cfg.episode.tool_timeout_s,
                    num_workers=self.cfg.episode.tool_workers,
                    max_chars=self.cfg.episode.max_tool_response_chars,
                )
                executor.start()
            self._toolsets[key] = (tools, delta, executor)
        return self._toolsets[key]

    def _start(
        self, driver: RequestDriver, key: str, number: int, row: dict[str, Any], params: SamplingParams
    ) -> EpisodeContext:
        env = self.make_env(row) if isinstance(self.make_env, EnvironmentChoice) else self.make_env()
        messages = _first_messages(env, row)
        tools, delta, _ = self._tools_of(env)
        if getattr(env, "in_process", False):  # stateful tools (bound methods): this episode's own instance's
            tools = tools.rebound(env.tools)
        prompt, vision, messages = _first_prompt(
            self.tokenizer, self.images, env, messages, tools, self.chat_template_kwargs
        )
        bound = self.max_prompt_length
        if bound is not None and len(prompt) > bound:
            raise ValueError(
                f"an episode's first prompt ({type(env).__name__}.reset's messages rendered by the chat template, "
                f"with the system turn and the tools' schemas) has {len(prompt)} tokens > PromptDataModule("
                f"max_prompt_length={bound}): {messages[-1].get('content')!r:.120}. The data module measures every "
                "dataset row's rendered prompt before training; this one came from reset() alone. HINT: raise "
                "max_prompt_length, or make reset() return shorter prompts."
            )
        info = Episode(row=row, messages=[dict(m) for m in messages])
        return EpisodeContext(
            self,
            driver,
            key,
            number,
            env,
            info,
            tools,
            delta,
            prompt,
            params,
            opening=_last_user(messages),
            vision=vision,
        )

    def in_thread(self, fn: Callable[..., Any], call: ToolCall) -> cf.Future[ToolResult]:
        """A stateful tool (a TRL-style environment's method) in a thread of this process, with the timeout: the
        future gives a timeout result once ``tool_timeout_s`` has passed (a coroutine is cancelled then; a plain call
        cannot be stopped, so its thread is abandoned to finish by itself). Runs on: the rollout's process."""
        timeout_s = self.cfg.episode.tool_timeout_s
        answer: cf.Future[ToolResult] = cf.Future()
        answer.set_running_or_notify_cancel()

        def finish(result: ToolResult) -> None:
            with contextlib.suppress(cf.InvalidStateError):  # the other of the call and its timer came first
                answer.set_result(result)

        timer = threading.Timer(
            timeout_s + 0.5,  # after a coroutine's own cancellation, which says the same
            finish,
            (tool_result(call.name, "timeout", f"timed out after {timeout_s:g} s", timeout_s),),
        )
        timer.daemon = True
        timer.start()
        work = self._threads.submit(_in_process, fn, call, self.cfg)
        work.add_done_callback(lambda done: finish(done.result()))
        answer.add_done_callback(lambda _: timer.cancel())
        return answer

    def run(
        self, engine: RolloutEngine, rows: list[dict[str, Any]], params: SamplingParams
    ) -> tuple[list[EpisodeContext], dict[Hashable, EpisodeOutcome], RequestDriver]:
        """Run one episode per row to its end with the agent loop, within the engine's context; returns them, how
        each ended, and the driver (its seconds in the engine). Runs on: the rollout's process. ``params``: the step's
        sampling settings (``n`` is ignored; each turn gets its own seed). Raises :class:`AgentLoopError` for a loop
        that raised or returned a value."""
        episode = self.cfg.episode
        self.context = engine.context_length
        driver = RequestDriver(
            engine.requests,
            lockstep=not episode.async_episodes,
            shared=engine.tp_size > 1,
            timeout_s=episode.episode_timeout_s,
        )
        rollout = next(self._rollouts)
        episodes = {
            f"{rollout}.{k}": self._start(driver, f"{rollout}.{k}", k, row, params) for k, row in enumerate(rows)
        }
        try:
            outcomes = asyncio.run(self._rollout(driver, {key: self._run_one(ep) for key, ep in episodes.items()}))
        finally:
            engine.requests.end_sessions(episodes)
        for key, outcome in outcomes.items():
            if outcome.timed_out:
                ep = episodes[str(key)]
                ep.truncate()
                ep.problem(
                    "episode_timeout",
                    f"its loop ran past EpisodeConfig(episode_timeout_s={episode.episode_timeout_s:g})",
                )
        return list(episodes.values()), outcomes, driver

    async def _rollout(
        self, driver: RequestDriver, coros: dict[Hashable, Coroutine[Any, Any, None]]
    ) -> dict[Hashable, EpisodeOutcome]:
        try:
            return await driver.run(coros)
        finally:
            await self.resources.aclose()

    async def _run_one(self, episode: EpisodeContext) -> None:
        try:
            returned = await cast(Any, self.loop).run(episode)  # a user's loop may return something
        except (asyncio.CancelledError, AgentLoopError):
            raise
        except Exception as err:
            where = (
                f"the agent loop {self.cfg.episode.agent_loop!r} ({type(self.loop).__name__}) raised in episode "
                f"{episode.key} ({type(episode.env).__name__}, turn {episode.info.turns})"
            )
            if isinstance(self.loop, ToolLoop):  # the built-in loop: the environment's own error, as it was raised
                err.add_note(where)
                raise
            raise AgentLoopError(f"{where}: {type(err).__name__}: {err}") from err
        if returned is not None:
            raise AgentLoopError(
                f"the agent loop {self.cfg.episode.agent_loop!r} ({type(self.loop).__name__}).run returned "
                f"{returned!r:.100}; an agent loop returns None (the episode is what it sampled and observed)."
            )


def _first_prompt(
    tokenizer: Any,
    images: ChatImages,
    env: Environment,
    messages: list[Message],
    tools: ToolSet,
    chat_kwargs: dict[str, Any],
) -> tuple[list[int], VisionInputs | None, list[Message]]:
    """An episode's first prompt: ``reset``'s messages rendered (with the tools' schemas), each image item's
    placeholder repeated per merged patch; its images' processor inputs (None: text); the messages with bare image
    items."""
    where = f"{type(env).__name__}.reset's messages"
    messages, decoded = images.split(messages, where=where)
    prompt = render_chat(tokenizer, messages, generation=True, tools=tools.schemas or None, **chat_kwargs)
    if not decoded:
        return prompt, None, messages
    prompt, vision = images.expand(prompt, decoded, where=where)
    return prompt, vision, messages


def _first_messages(env: Environment, row: dict[str, Any]) -> list[Message]:
    messages = env.reset(row)
    if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError(
            f"{type(env).__name__}.reset(row) returned {messages!r}; expected a non-empty list of chat messages "
            "({'role': ..., 'content': ...}). HINT: return at least the user's first turn."
        )
    return messages


def episode_prompt_ids(
    make_env: Callable[..., Environment],
    tokenizer: Any,
    rows: Sequence[dict[str, Any]],
    *,
    chat_template_kwargs: dict[str, Any] | None = None,
    images: ChatImages | None = None,
) -> list[tuple[list[int], str]]:
    """Each row's episode prompt as the rollout renders it (``reset(row)``'s messages, the system turn and the
    tools' schemas, by the chat template with ``chat_template_kwargs``; each image item's placeholder repeated per
    merged patch by ``images``, None: an image is refused), and the text reward functions get as its ``prompt`` (the
    last user message). One environment per environment class is made and reset once per row. Runs on: every process,
    in ``PromptDataModule.setup`` (before any model loads). Raises ValueError for a ``reset`` that returns no
    messages, or an image that cannot be decoded."""
    kwargs = dict(chat_template_kwargs or {})
    images = images or ChatImages(tokenizer, None)
    envs: dict[Any, tuple[Environment, ToolSet]] = {}
    out = []
    for row in rows:
        key = row.get("environment") if isinstance(make_env, EnvironmentChoice) else None
        if key not in envs:
            env = make_env(row) if isinstance(make_env, EnvironmentChoice) else make_env()
            envs[key] = (env, ToolSet(env.tools))
        env, tools = envs[key]
        prompt, _, messages = _first_prompt(tokenizer, images, env, _first_messages(env, row), tools, kwargs)
        out.append((prompt, _last_user(messages)))
    return out


def check_environment(
    make_env: Callable[..., Environment], tokenizer: Any, tool_parser: str = "auto", loop: str = "tools"
) -> None:
    """Make one environment and check what every episode would meet at its first turn (its tools' JSON schemas, the
    chat template, the format its calls are read in, the agent loop ``loop`` names), so that a mistake is a clear error
    when the module is built. Runs on: every process, when the module is built (the controller's error comes first).
    Raises ValueError."""
    agent_loop(loop)
    resolve_tool_parser(tool_parser, tokenizer)
    for make in make_env.factories.values() if isinstance(make_env, EnvironmentChoice) else [make_env]:
        _tools_and_delta(make(), tokenizer)


def _tools_and_delta(
    env: Environment, tokenizer: Any, chat_kwargs: dict[str, Any] | None = None
) -> tuple[ToolSet, ChatDelta]:
    """The environment's tools (their schemas checked) and the chat delta that renders them with the extra template
    arguments (the template checked)."""
    tools = ToolSet(env.tools)
    kwargs = dict(chat_kwargs or {}) | ({"tools": tools.schemas} if len(tools) else {})
    return tools, check_chat_template(tokenizer, tool_turns=len(tools) > 0, **kwargs)


def _episode_score(ep: EpisodeContext, reward: Any) -> float:
    """The environment's score of an episode: ``reward(episode)`` plus its turn rewards (NaN: neither)."""
    turns = ep.info.turn_rewards
    if not turns:
        return math.nan if reward is None else float(reward)
    env = getattr(ep.env, "inner", ep.env)
    if not scores_episodes(env):
        raise ValueError(
            f"{type(env).__name__}.step returned per-turn rewards, but {type(env).__name__} has no reward(episode), so "
            "the module does not count the environment's score. HINT: define reward(episode) on it (the turn rewards "
            "are added to what it returns; `return 0.0` scores the episode by its turn rewards alone)."
        )
    return (0.0 if reward is None else float(reward)) + float(sum(turns))


def _in_process(fn: Callable[..., Any], call: ToolCall, cfg: RolloutConfig) -> ToolResult:
    """A stateful tool (a TRL-style environment's method) in a thread of the rollout's process. It may return images
    (a PIL image, or a list of images and text): they go into its message as image items."""
    from lightning_rlhf.sandbox.worker import tool_answer

    start = time.monotonic()
    images: tuple[Any, ...] = ()
    try:
        value = fn(**call.arguments)
        if inspect.isawaitable(value):  # an ``async def`` method: its own event loop, cancelled at the timeout
            value = asyncio.run(asyncio.wait_for(value, cfg.episode.tool_timeout_s))
    except TimeoutError:
        kind, text = "timeout", f"timed out after {cfg.episode.tool_timeout_s:g} s"
    except Exception as err:
        kind, text = "raised", f"{type(err).__name__}: {err}"
    else:
        images, value = tool_images(value)
        if images and value is None:  # images alone
            kind, text = "ok", ""
        else:
            kind, text = tool_answer(value, max_chars=cfg.episode.max_tool_response_chars)
    result = tool_result(call.name, kind, text, time.monotonic() - start)
    return dataclasses.replace(result, images=images) if images and kind == "ok" else result


def _settled(values: list[Any]) -> list[Any]:
    """``values`` with each awaitable one (an ``async def reward``'s, e.g. an LLM judge's) replaced by its result, all
    of them awaited at once in one event loop."""
    waiting = [i for i, v in enumerate(values) if inspect.isawaitable(v)]
    if waiting:

        async def gather() -> list[Any]:
            return await asyncio.gather(*(values[i] for i in waiting))

        for i, value in zip(waiting, asyncio.run(gather()), strict=True):
            values[i] = value
    return values


def sample_episodes(
    engine: RolloutEngine,
    batch: Batch,
    runner: EpisodeRunner,
    params: SamplingParams,
    *,
    n: int,
    pad_id: int,
) -> Batch:
    """Episodes for this rank's prompts, ``n`` per prompt: one row each, with the batch layout of a single-turn
    rollout (``prompts``/``prompt_mask`` now the rendered first messages, ``responses``, ``response_mask``,
    ``response_truncated``, ``rollout_logprobs``) plus ``sampled_mask`` (the sampled tokens), the episode counters
    (``turns``, ``tool_calls``, ``tool_errors``, ``tool_s``, ``observation_tokens``), ``episode`` (the messages),
    ``env_reward`` (NaN: none), ``turn_rewards`` and ``episode_problems`` (the first message of each kind met).

    Runs on: a worker rank holding a rollout engine.
    """
    rollout = batch.select(torch.arange(len(batch)).repeat_interleave(n))
    rows = [{k: v[i] for k, v in rollout.columns.items()} for i in range(len(rollout))]
    runner.take_meta(batch)
    t0 = time.perf_counter()
    episodes, outcomes, driver = runner.run(engine, rows, params)
    wall_s = time.perf_counter() - t0
    rollout = episode_rows(rollout, episodes, [outcome.timed_out for outcome in outcomes.values()], pad_id=pad_id)
    rollout.meta.update(gen_s=driver.engine_s, episodes_s=wall_s, group_size=n, engine_steps=driver.steps)
    return rollout


def episode_rows(
    rollout: Batch, episodes: Sequence[EpisodeContext], timed_out: Sequence[bool], *, pad_id: int
) -> Batch:
    """``rollout`` (a row per episode, the input columns) with the episodes' columns (see :func:`sample_episodes`).
    Runs on: a worker rank holding a rollout engine."""
    rwidth = max(1, max(len(ep.ids) for ep in episodes))
    rollout["prompts"] = _padded([ep.prompt for ep in episodes], pad_id, left=True)
    rollout["prompt_mask"] = _padded([[1] * len(ep.prompt) for ep in episodes], 0, left=True)
    rollout["responses"] = _padded([ep.ids for ep in episodes], pad_id, width=rwidth)
    rollout["response_mask"] = _padded([[1] * len(ep.ids) for ep in episodes], 0, width=rwidth)
    rollout["sampled_mask"] = _padded([ep.sampled for ep in episodes], 0, width=rwidth)
    rollout["rollout_logprobs"] = _padded([ep.logprobs for ep in episodes], 0, width=rwidth, dtype=torch.float32)
    rollout["response_truncated"] = torch.tensor([ep.info.truncated for ep in episodes])
    for key in ("turns", "tool_calls", "tool_errors"):
        rollout[key] = torch.tensor([getattr(ep.info, key) for ep in episodes])
    rollout["tool_s"] = torch.tensor([ep.tool_s for ep in episodes], dtype=torch.float32)
    rollout["observation_tokens"] = torch.tensor([ep.observation_tokens for ep in episodes])
    for kind in TOOL_ERROR_KINDS:
        rollout[f"tool_errors/{kind}"] = torch.tensor([ep.errors.get(kind, 0) for ep in episodes])
    rollout["observation_overflow"] = torch.tensor(["observation_overflow" in ep.problems for ep in episodes])
    rollout["episode_timeout"] = torch.tensor(list(timed_out))
    rewards = _settled([ep.env.reward(ep.info) for ep in episodes])
    rollout["env_reward"] = [_episode_score(ep, r) for ep, r in zip(episodes, rewards, strict=True)]
    rollout["turn_rewards"] = [list(ep.info.turn_rewards) for ep in episodes]
    rollout["episode_problems"] = [dict(ep.problems) for ep in episodes]
    rollout["episode"] = [ep.info.messages for ep in episodes]
    if any(ep.vision is not None for ep in episodes):  # the prompts' and observations' images, in order
        rollout[VISION_COLUMN] = [ep.vision for ep in episodes]
    if "prompt" in rollout.columns:  # a row without a prompt (the environment made it): its first user message
        rollout["prompt"] = [
            p if isinstance(p, str) and p.strip() else ep.opening
            for p, ep in zip(rollout["prompt"], episodes, strict=True)
        ]
    return rollout


def _padded(
    rows: list[list[Any]], fill: int, *, left: bool = False, width: int = 0, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """``rows`` as one ``[len(rows), width or the longest]`` tensor, padded with ``fill`` (``left``: on the left)."""
    width = width or max(len(row) for row in rows)
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, row in enumerate(rows):
        start = width - len(row) if left else 0
        out[i, start : start + len(row)] = torch.tensor(row, dtype=dtype)
    return out


def _last_user(messages: list[Message]) -> str:
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    return users[-1] if users and isinstance(users[-1], str) else ""


def episode_metrics(rollout: Batch) -> dict[str, float]:
    """The episodes' metrics of a rollout (``rollout/turns/mean`` ..., listed in docs/metrics.md; empty for
    single-turn rollouts). The first problem of each kind in the batch (:data:`PROBLEM_KINDS`) is logged as a
    warning by this module's logger, with how many episodes met it. Runs on: controller, once per step."""
    if "turns" not in rollout:
        return {}
    turns = rollout["turns"].float()
    out = {
        "rollout/turns/mean": float(turns.mean()),
        "rollout/turns/max": float(turns.max()),
        "rollout/tool_calls/mean": float(rollout["tool_calls"].float().mean()),
        "rollout/tool_errors": float(rollout["tool_errors"].sum()),
        "rollout/tool_s/mean": float(rollout["tool_s"].float().mean()),
        "rollout/observation_tokens/mean": float(rollout["observation_tokens"].float().mean()),
        "rollout/truncated": float(rollout["response_truncated"].float().mean()),
    }
    for key in [*(f"tool_errors/{kind}" for kind in TOOL_ERROR_KINDS), "observation_overflow", "episode_timeout"]:
        if key in rollout:
            out[f"rollout/{key}"] = float(rollout[key].sum())
    turn_rewards = rollout.columns.get("turn_rewards")
    if turn_rewards and any(turn_rewards):
        out["rollout/turn_rewards/mean"] = sum(sum(t) for t in turn_rewards) / len(turn_rewards)
    _log_problems(rollout.columns.get("episode_problems") or [])
    env = torch.tensor(rollout["env_reward"], dtype=torch.float32)
    if not env.isnan().all():
        out["rollout/env_reward/mean"] = float(env.nanmean())
    return out


def _log_problems(problems: list[dict[str, str]]) -> None:
    """Warn once per kind of problem the step's episodes met: the first one's words and how many episodes met it."""
    for kind in PROBLEM_KINDS:
        met = [p[kind] for p in problems if kind in p]
        if not met:
            continue
        if kind == "observation_overflow":
            log.warning(
                "%d of %d episodes ended truncated because an observation did not fit (first: %s). HINT: lower "
                "RolloutConfig(max_tool_response_chars=), have the tool return less, or raise max_episode_tokens "
                "(within the model's context).",
                len(met), len(problems), met[0],
            )  # fmt: skip
        elif kind == "episode_timeout":
            log.warning(
                "%d of %d episodes were cut because their agent loop ran too long (%s). HINT: raise "
                "EpisodeConfig(episode_timeout_s=), or await slow calls of your own with `await episode.wait(...)`.",
                len(met), len(problems), met[0],
            )  # fmt: skip
        elif kind in TOOL_ERROR_KINDS:
            log.warning("tool calls failed (%s) in %d of %d episodes; first: %s", kind, len(met), len(problems), met[0])
        else:
            log.warning("%s in %d of %d episodes; first: %s", kind, len(met), len(problems), met[0])
