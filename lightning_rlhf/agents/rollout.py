"""Multi-turn episodes: each turn, the live episodes generate in one engine call; their tool calls run in tool
workers; an episode goes on as soon as its observation is ready. Token in, token out: an episode's ids are its
prompt's, then each turn's ids as the engine sampled them, then each observation's ids; the conversation is never
tokenized again from text. An episode never ends on an observation: the reward's last token is a sampled one.
Limits, scheduling and the columns written: docs/agents.md.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import dataclasses
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_rlhf.agents.env import Environment, EnvironmentChoice, Episode, Message, scores_episodes
from lightning_rlhf.agents.parsing import ToolCall, get_tool_parser, parse_with_template, resolve_tool_parser
from lightning_rlhf.agents.tokens import ChatDelta, check_chat_template, render_chat
from lightning_rlhf.agents.tools import ToolSet
from lightning_rlhf.batch import Batch
from lightning_rlhf.config import RolloutConfig
from lightning_rlhf.engines.rollout.base import RolloutEngine, SamplingParams
from lightning_rlhf.sandbox.tools import ToolExecutor, ToolResult, tool_result

__all__ = [
    "PROBLEM_KINDS",
    "EpisodeRunner",
    "check_environment",
    "episode_metrics",
    "episode_prompt_ids",
    "sample_episodes",
]

log = logging.getLogger(__name__)

TOOL_ERROR_KINDS = ("malformed", "raised", "timeout", "crash", "invalid_result")
"""How a tool call can fail (each kind explained in docs/agents.md, "What you see")."""

PROBLEM_KINDS = (*TOOL_ERROR_KINDS, "observation_overflow")
"""The kinds of problem an episode reports: the tool errors, and ``observation_overflow`` (an observation did not
fit the room the episode had left, so it ended truncated)."""

_PREFIX_IDS = 32
"""Ids before a turn handed to a ``response_template`` parser: its generation prompt (what the template may have
written of the reply already, such as an opening think tag) with room to spare."""

_TURN_SEED = 15_485_863  # a prime: the seeds of successive engine calls never meet


@dataclasses.dataclass
class _Live:
    """One episode while it runs."""

    env: Environment
    info: Episode
    tools: ToolSet
    delta: ChatDelta
    prompt: list[int]
    ids: list[int] = dataclasses.field(default_factory=list)  # after the prompt
    sampled: list[int] = dataclasses.field(default_factory=list)  # 1: sampled, 0: observation
    logprobs: list[float] = dataclasses.field(default_factory=list)
    # per call: a future, an error text, or the environment's own message
    pending: list[tuple[ToolCall, Any]] = dataclasses.field(default_factory=list)
    last_id: int | None = None
    done: bool = False
    tool_s: float = 0.0
    observation_tokens: int = 0
    errors: dict[str, int] = dataclasses.field(default_factory=dict)  # tool errors by kind (TOOL_ERROR_KINDS)
    problems: dict[str, str] = dataclasses.field(default_factory=dict)  # the first message of each PROBLEM_KINDS
    opening: str = ""  # the last user message of reset's messages

    def problem(self, kind: str, text: str) -> None:
        """Count a problem of ``kind`` (a tool error or an overflow), keeping the first one's words."""
        if kind in TOOL_ERROR_KINDS:
            self.errors[kind] = self.errors.get(kind, 0) + 1
            self.info.tool_errors += 1
        self.problems.setdefault(kind, text)


class EpisodeRunner:
    """What one rank needs to run episodes for an environment: the tool executors, the chat deltas, the parser.
    Made once per role and kept across steps (its tool workers live as long as it does). ``make_env``: what
    :func:`~lightning_rlhf.agents.env.environment_factory` makes.

    Runs on: the process that runs the rollout (a worker rank with a rollout engine).
    """

    def __init__(
        self, make_env: Callable[[], Environment], tokenizer: Any, cfg: RolloutConfig, *, model_path: str | None = None
    ) -> None:
        self.make_env = make_env
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.context = _model_context(model_path)  # the model's positions; None: its config states none
        self.budget = cfg.episode.max_episode_tokens or cfg.max_new_tokens * cfg.episode.max_turns  # after the prompt
        self.tool_format = resolve_tool_parser(cfg.episode.tool_parser, tokenizer)  # "auto" resolved
        self.parse = None if self.tool_format == "template" else get_tool_parser(self.tool_format)
        self._toolsets: dict[tuple[Any, ...], tuple[ToolSet, ChatDelta, ToolExecutor | None]] = {}
        # The data module's chat_template_kwargs and max_prompt_length (None: no bound), set per rollout.
        self.chat_template_kwargs: dict[str, Any] = {}
        self.max_prompt_length: int | None = None
        self._context: int | None = None  # the context bound of the run in progress
        self._threads = cf.ThreadPoolExecutor(max(1, cfg.episode.tool_workers), thread_name_prefix="lightning-rlhf-env")

    def close(self) -> None:
        """End the tool workers and threads. Idempotent. Runs on: the rollout's process, at teardown."""
        for _, _, executor in self._toolsets.values():
            if executor is not None:
                executor.close()
        self._toolsets.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)

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

    def _start(self, row: dict[str, Any]) -> _Live:
        env = self.make_env(row) if isinstance(self.make_env, EnvironmentChoice) else self.make_env()
        messages = _first_messages(env, row)
        tools, delta, _ = self._tools_of(env)
        if getattr(env, "in_process", False):  # stateful tools (bound methods): this episode's own instance's
            tools = tools.rebound(env.tools)
        kwargs = self.chat_template_kwargs
        prompt = render_chat(self.tokenizer, messages, generation=True, tools=tools.schemas or None, **kwargs)
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
        return _Live(env=env, info=info, tools=tools, delta=delta, prompt=prompt, opening=_last_user(messages))

    def _after_turn(self, ep: _Live, turn: list[int], logprobs: Sequence[float], stops: set[int], limit: int) -> None:
        """Append a sampled turn; end the episode or start its observation (tools, or the environment's step)."""
        turn = turn[:limit]
        ep.ids += turn
        ep.sampled += [1] * len(turn)
        ep.logprobs += list(logprobs[: len(turn)]) + [0.0] * (len(turn) - len(logprobs))
        ep.last_id = turn[-1] if turn else None
        ep.info.turns += 1
        text = self.tokenizer.decode(turn, skip_special_tokens=True)
        message: Message = {"role": "assistant", "content": text}
        ep.info.messages.append(message)
        if not turn or turn[-1] not in stops:  # cut by the turn's (or the episode's) token limit
            ep.info.truncated = ep.done = True
            return
        answered = ep.env.step(message)
        if answered is not None:
            observation, done, turn_reward = _step_answer(answered, ep.env)
            if turn_reward is not None:
                ep.info.turn_rewards.append(turn_reward)
            if done:
                ep.done = True
                return
            ep.pending = [(ToolCall("", raw="environment"), m) for m in _messages(observation, ep.env)]
        else:
            if self.parse is None:
                end = len(ep.ids) - len(turn)  # the ids before the turn: its generation prompt and a little more
                before = (ep.prompt[-_PREFIX_IDS:] + ep.ids[max(0, end - _PREFIX_IDS) : end])[-_PREFIX_IDS:]
                calls = parse_with_template(self.tokenizer, turn, before, ep.tools.schemas).calls
            else:
                calls = self.parse(text).calls
            if not calls:
                ep.done = True
                return
            ep.info.tool_calls += len(calls)
            _, _, executor = self._tools_of(ep.env)
            for call in calls:
                problem = ep.tools.check(call)
                if problem is not None:
                    ep.problem("malformed", f"{call.raw!r:.200}: {problem}")
                    ep.pending.append((call, f"error: {problem}"))
                elif executor is None:  # stateful tools of a TRL-style environment: in this process
                    ep.pending.append((call, self._in_thread(ep.tools.functions[call.name], call)))
                else:
                    ep.pending.append((call, executor.submit(call)))
        if ep.info.turns >= self.cfg.episode.max_turns:  # its observation would never be answered
            for _, pending in ep.pending:
                if isinstance(pending, cf.Future):
                    pending.cancel()
            ep.pending = []
            ep.info.truncated = ep.done = True

    def _in_thread(self, fn: Callable[..., Any], call: ToolCall) -> cf.Future[ToolResult]:
        """A stateful tool (a TRL-style environment's method) in a thread of this process, with the timeout: the
        future gives a timeout result once ``tool_timeout_s`` has passed (a coroutine is cancelled then; a plain call
        cannot be stopped, so its thread is abandoned to finish by itself)."""
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

    def _room(self, ep: _Live) -> int:
        """The tokens the episode has left: of its budget, and of the model's context."""
        left = self.budget - len(ep.ids)
        return left if self._context is None else min(left, self._context - len(ep.prompt) - len(ep.ids))

    def _ready(self, ep: _Live) -> bool:
        return all(not isinstance(p, cf.Future) or p.done() for _, p in ep.pending)

    def _observe(self, ep: _Live) -> None:
        """Append the episode's observation (tool results or the environment's turns), or end it if it does not fit."""
        messages: list[Message] = []
        for call, pending in ep.pending:
            if isinstance(pending, dict):  # the environment's own message
                messages.append(pending)
                continue
            if isinstance(pending, cf.Future):
                result = pending.result()
                ep.tool_s += result.seconds
                if result.kind != "ok":
                    ep.problem(result.kind, result.text)
                text = result.text
            else:
                text = pending
            messages.append({"role": "tool", "name": call.name or "error", "content": text})
        ep.pending = []
        obs = ep.delta.observation_ids(messages, last_id=ep.last_id)
        room = self._room(ep)
        if len(obs) + 1 > room:  # no room for the observation and one more sampled token
            ep.info.truncated = ep.done = True
            longest = max((len(str(m.get("content", ""))) for m in messages), default=0)
            ep.problem(
                "observation_overflow",
                f"an observation of {len(obs)} tokens (its longest message {longest} characters, tool results cut at "
                f"RolloutConfig(max_tool_response_chars={self.cfg.episode.max_tool_response_chars})) did not fit the "
                f"{max(room - 1, 0)} tokens the episode had left",
            )
            return
        ep.ids += obs
        ep.sampled += [0] * len(obs)
        ep.logprobs += [0.0] * len(obs)
        ep.observation_tokens += len(obs)
        ep.info.messages += messages

    def run(
        self, engine: RolloutEngine, rows: list[dict[str, Any]], params: SamplingParams, *, context: int | None
    ) -> tuple[list[_Live], float]:
        """Run one episode per row to its end, within ``context`` tokens (None: no bound); returns them and the
        seconds spent in the engine. Runs on: the rollout's process. ``params``: the step's sampling settings (``n``
        is ignored; each call gets its own seed)."""
        cfg, self._context = self.cfg, context
        stops = set(params.stop_token_ids)
        episodes = [self._start(row) for row in rows]
        if cfg.episode.async_episodes and engine.abilities.streams_requests:
            return episodes, self._run_streaming(engine, episodes, params, stops)
        ready = list(episodes)
        calls = 0
        gen_s = 0.0
        # The transformers engine keeps each episode's keys and values between its turns: a turn runs only the tokens
        # past what the episode's previous turn ran (the last turn's tail and the observation); and it bounds each
        # episode's turn by the episode's own limit, so episodes near the context's end share the others' call.
        continues = engine.abilities.continues_sequences
        number = {id(ep): k for k, ep in enumerate(episodes)}
        # at TP > 1 each engine call is collective: the ranks of the TP group agree on each round's number of calls
        # (a rank with fewer, or with no episode left, makes the rest with no prompts) and end together
        shared = engine.tp_size > 1
        if continues:
            engine.forget()  # type: ignore[attr-defined]
        while True:
            waiting = [ep for ep in episodes if ep.pending]
            if cfg.episode.async_episodes:
                ready += [ep for ep in waiting if self._ready(ep)]
                if not ready and waiting and not shared:
                    _wait_any(waiting)
                    continue
            elif not ready:
                ready = waiting
            for ep in [ep for ep in ready if ep.pending]:
                self._observe(ep)
            ready = [ep for ep in ready if not ep.done]
            limits = [min(cfg.max_new_tokens, self._room(ep)) for ep in ready]
            # other engines: calls whose longest sequence and largest limit fit the context
            groups = [list(range(len(ready)))] if continues else _fitting_calls(ready, limits, context) if ready else []
            rounds, busy = len(groups), bool(ready) or any(ep.pending for ep in episodes)
            if shared:
                rounds, busy = engine.agree(rounds, busy)
            if not busy:
                break
            if not rounds:  # tools still run (here or, at TP > 1, on another rank of the group)
                waiting = [ep for ep in episodes if ep.pending]
                if waiting and cfg.episode.async_episodes:
                    _wait_any(waiting)
                continue
            for k in range(rounds):
                seed = (params.seed + calls * _TURN_SEED) % (1 << 62)
                calls += 1
                if k >= len(groups):  # the other ranks' calls of this round (TP > 1)
                    engine.generate([], dataclasses.replace(params, seed=seed))
                    continue
                eps, bounds = [ready[i] for i in groups[k]], [limits[i] for i in groups[k]]
                gen_s += self._turns(engine, eps, bounds, params, seed, stops, number if continues else None)
            ready = []
        if continues:
            engine.forget()  # type: ignore[attr-defined]
        return episodes, gen_s

    def _turns(
        self,
        engine: RolloutEngine,
        eps: list[_Live],
        limits: list[int],
        params: SamplingParams,
        seed: int,
        stops: set[int],
        number: dict[int, int] | None,
    ) -> float:
        """One engine call for the next turn of episodes ``eps`` (each bounded by its limit), the samples of one
        prompt together; returns the seconds in the engine. ``number``: each episode's key of its kept sequence
        on an engine that continues sequences (None: the engine does not)."""
        group, copies = _samples_of_one_prompt(list(range(len(eps))), eps, params)
        eps, limits = [eps[i] for i in group], [limits[i] for i in group]
        call = dataclasses.replace(params, n=copies, max_new_tokens=max(limits), seed=seed)
        prompts = [ep.prompt + ep.ids for ep in eps[::copies]]
        handled: set[int] = set()  # the call's turns ended while its others decoded: their tools run

        def early(k: int, turn: list[int], logprobs: list[float]) -> None:  # the engine's on_done: tools start now
            handled.add(k)
            self._after_turn(eps[k], turn, logprobs, stops, limits[k])

        t0 = time.perf_counter()
        if number is not None:
            out = engine.generate(  # type: ignore[call-arg]
                prompts, call,
                continues=[number[id(ep)] for ep in eps[::copies]],
                keep_as=[number[id(ep)] for ep in eps],
                limits=limits[::copies],
                on_done=early if self.cfg.episode.async_episodes else None,
            )  # fmt: skip
        else:
            out = engine.generate(prompts, call)
        gen_s = time.perf_counter() - t0
        logprobs = out.logprobs or [[] for _ in out.responses]
        for k, (ep, turn, lp, limit) in enumerate(zip(eps, out.responses, logprobs, limits, strict=True)):
            if k not in handled:
                self._after_turn(ep, list(turn), lp, stops, limit)
        return gen_s

    def _run_streaming(self, engine: Any, episodes: list[_Live], params: SamplingParams, stops: set[int]) -> float:
        """Episodes on an engine that takes requests while others decode (vLLM at TP 1): an episode's next turn is
        added as soon as its observation is ready, and the engine steps on; returns the seconds in engine steps."""
        limits: dict[int, int] = {}
        ready = list(range(len(episodes)))
        gen_s = 0.0
        while True:
            for i, ep in enumerate(episodes):
                if ep.pending and self._ready(ep):
                    self._observe(ep)
                    ready.append(i)
            for i in ready:
                ep = episodes[i]
                if ep.done:
                    continue
                limits[i] = min(self.cfg.max_new_tokens, self._room(ep))
                turn = dataclasses.replace(
                    params, n=1, max_new_tokens=limits[i], seed=(params.seed + ep.info.turns * _TURN_SEED) % (1 << 62)
                )
                engine.add_requests([(i, ep.prompt + ep.ids)], turn)
            ready = []
            if engine.has_requests():
                t0 = time.perf_counter()
                finished = engine.step_requests()
                gen_s += time.perf_counter() - t0
                for i, turn_ids, logprobs in finished:
                    self._after_turn(episodes[i], list(turn_ids), logprobs, stops, limits[i])
            elif any(ep.pending for ep in episodes):
                _wait_any(episodes)
            else:
                return gen_s


def _wait_any(episodes: list[_Live]) -> None:
    cf.wait([p for ep in episodes for _, p in ep.pending if isinstance(p, cf.Future)], return_when=cf.FIRST_COMPLETED)


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
) -> list[tuple[list[int], str]]:
    """Each row's episode prompt as the rollout renders it (``reset(row)``'s messages, the system turn and the
    tools' schemas, by the chat template with ``chat_template_kwargs``), and the text reward functions get as its
    ``prompt`` (the last user message). One environment per environment class is made and reset once per row.
    Runs on: every process, in ``PromptDataModule.setup`` (before any model loads). Raises ValueError for a
    ``reset`` that returns no messages."""
    kwargs = dict(chat_template_kwargs or {})
    envs: dict[Any, tuple[Environment, ToolSet]] = {}
    out = []
    for row in rows:
        key = row.get("environment") if isinstance(make_env, EnvironmentChoice) else None
        if key not in envs:
            env = make_env(row) if isinstance(make_env, EnvironmentChoice) else make_env()
            envs[key] = (env, ToolSet(env.tools))
        env, tools = envs[key]
        messages = _first_messages(env, row)
        prompt = render_chat(tokenizer, messages, generation=True, tools=tools.schemas or None, **kwargs)
        out.append((prompt, _last_user(messages)))
    return out


def check_environment(make_env: Callable[..., Environment], tokenizer: Any, tool_parser: str = "auto") -> None:
    """Make one environment and check what every episode would meet at its first turn (its tools' JSON schemas, the
    chat template, the format its calls are read in), so that a mistake is a clear error when the module is built.
    Runs on: every process, when the module is built (the controller's error comes first). Raises ValueError."""
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


def _model_context(model_path: str | None) -> int | None:
    if model_path is None:
        return None
    from transformers import AutoConfig

    from lightning_rlhf.engines.rollout.hf import model_max_length

    try:
        return model_max_length(AutoConfig.from_pretrained(model_path))
    except (OSError, ValueError):  # no config to read (an embedded name resolved elsewhere): no bound here
        return None


def _fitting_calls(ready: list[_Live], limits: list[int], context: int | None) -> list[list[int]]:
    """A lock-step turn's episodes (indices into ``ready``) split into engine calls whose longest sequence plus the
    call's ``max_new_tokens`` (its largest limit) fits the model's context: usually one call; episodes near the end
    of the context, whose limit is their room, go into calls of their own."""
    groups: list[list[int]] = []
    tops: list[int] = []
    for i in sorted(range(len(ready)), key=lambda i: -limits[i]):
        length = len(ready[i].prompt) + len(ready[i].ids)
        for group, top in zip(groups, tops, strict=True):
            if context is None or length + top <= context:
                group.append(i)
                break
        else:
            groups.append([i])
            tops.append(limits[i])
    return [sorted(group) for group in groups]


def _samples_of_one_prompt(group: list[int], ready: list[_Live], params: SamplingParams) -> tuple[list[int], int]:
    """``(group in call order, copies)``: where the call's episodes are ``copies`` episodes each of the same tokens
    so far (a GRPO group's first turn), one engine call samples ``copies`` responses per distinct prompt, so the
    engine reads each prompt once (the transformers engine's prompt pass and its decoding attention over the prompt
    are per prompt, not per sample); ``group`` is then ordered prompt by prompt. Else ``(group, 1)``."""
    if params.is_greedy or len(group) < 2:
        return group, 1
    same: dict[tuple[int, ...], list[int]] = {}
    for i in group:
        same.setdefault((*ready[i].prompt, *ready[i].ids), []).append(i)
    sizes = {len(members) for members in same.values()}
    if len(sizes) != 1 or sizes == {1}:
        return group, 1
    return [i for members in same.values() for i in members], sizes.pop()


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


def _episode_score(ep: _Live, reward: Any) -> float:
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


def _messages(observation: Any, env: Environment) -> list[Message]:
    if not isinstance(observation, list) or not all(isinstance(m, dict) and "role" in m for m in observation):
        raise ValueError(
            f"{type(env).__name__}.step returned {observation!r} as its observation; expected a list of chat messages "
            "({'role': 'user' or 'tool', 'content': ...}). HINT: return (messages, done), or None to run the tool "
            "calls."
        )
    return [dict(m) for m in observation]


def _in_process(fn: Callable[..., Any], call: ToolCall, cfg: RolloutConfig) -> ToolResult:
    """A stateful tool (a TRL-style environment's method) in a thread of the rollout's process."""
    from lightning_rlhf.sandbox.worker import tool_answer

    start = time.monotonic()
    try:
        value = fn(**call.arguments)
        if inspect.isawaitable(value):  # an ``async def`` method: its own event loop, cancelled at the timeout
            value = asyncio.run(asyncio.wait_for(value, cfg.episode.tool_timeout_s))
    except TimeoutError:
        kind, text = "timeout", f"timed out after {cfg.episode.tool_timeout_s:g} s"
    except Exception as err:
        kind, text = "raised", f"{type(err).__name__}: {err}"
    else:
        kind, text = tool_answer(value, max_chars=cfg.episode.max_tool_response_chars)
    return tool_result(call.name, kind, text, time.monotonic() - start)


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
    runner.chat_template_kwargs = dict(batch.meta.get("chat_template_kwargs") or {})
    runner.max_prompt_length = batch.meta.get("max_prompt_length")
    t0 = time.perf_counter()
    episodes, gen_s = runner.run(engine, rows, params, context=runner.context)
    wall_s = time.perf_counter() - t0
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
    rewards = _settled([ep.env.reward(ep.info) for ep in episodes])
    rollout["env_reward"] = [_episode_score(ep, r) for ep, r in zip(episodes, rewards, strict=True)]
    rollout["turn_rewards"] = [list(ep.info.turn_rewards) for ep in episodes]
    rollout["episode_problems"] = [dict(ep.problems) for ep in episodes]
    rollout["episode"] = [ep.info.messages for ep in episodes]
    if "prompt" in rollout.columns:  # a row without a prompt (the environment made it): its first user message
        rollout["prompt"] = [
            p if isinstance(p, str) and p.strip() else ep.opening
            for p, ep in zip(rollout["prompt"], episodes, strict=True)
        ]
    rollout.meta.update(gen_s=gen_s, episodes_s=wall_s, group_size=n)
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
    for key in [*(f"tool_errors/{kind}" for kind in TOOL_ERROR_KINDS), "observation_overflow"]:
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
        else:
            log.warning("tool calls failed (%s) in %d of %d episodes; first: %s", kind, len(met), len(problems), met[0])
