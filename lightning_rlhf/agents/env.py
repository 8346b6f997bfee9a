"""Environments: where an episode starts (``reset(row)``), what answers the model's turns (``step(message)``), and
what the episode is worth (``reward(episode)``); the rollout makes one instance per episode. A class in TRL's
``environment_factory`` style works too (:func:`as_environment` wraps it); its tools are bound methods that keep the
instance's state, so they run in the rollout's process (in a thread, with the timeout). The methods and their
defaults: docs/agents.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_rlhf.sandbox import IN_PROCESS

__all__ = [
    "ENVIRONMENT_COLUMN",
    "Environment",
    "EnvironmentChoice",
    "Episode",
    "ToolEnvironment",
    "as_environment",
    "environment_factory",
    "environment_reward",
    "resolve_environment",
    "scores_episodes",
    "with_environment_reward",
]

Message = dict[str, Any]


@dataclass
class Episode:
    """One episode as the reward sees it: the dataset ``row``, the whole conversation (``messages``, the first
    turns and every assistant and observation turn) and how it ended."""

    row: Mapping[str, Any]
    messages: list[Message] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    truncated: bool = False
    turn_rewards: list[float] = field(default_factory=list)
    """The per-turn rewards ``step`` returned, in turn order (added to the episode's score)."""


class Environment:
    """The base class: override :meth:`reset`, :meth:`step` and :meth:`reward` as the task needs.

    Runs on: the process that runs the rollout (a worker rank), one instance per episode. ``tools`` (plain
    functions with type hints and Google-style docstrings) are rendered into the prompt by the chat template.
    """

    tools: Sequence[Callable[..., Any]] = ()
    system_prompt: str | None = None

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """The episode's first messages, from the dataset row: its chat messages (the column
        ``PromptDataModule(messages_column=...)`` reads), else its ``prompt`` text as one user turn; with
        ``system_prompt``, a system turn first. Runs on: the rollout's process."""
        messages: list[Message]
        for value in row.values():  # the chat column (PromptDataModule's messages_column), whatever its name
            if _is_chat(value):
                messages = [dict(m) for m in value]
                break
        else:
            text = row.get("prompt")
            if not isinstance(text, str) or not text.strip():
                raise ValueError(
                    f"{type(self).__name__}.reset: the row has no chat messages and no prompt text (columns: "
                    f"{sorted(row)}). HINT: override reset(row) to build the first messages from your columns (an "
                    "environment that makes its own tasks returns them from reset)."
                )
            messages = [{"role": "user", "content": text}]
        if self.system_prompt and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def step(self, message: Message) -> tuple[list[Message], bool] | tuple[list[Message], bool, float] | None:
        """The observation after an assistant turn and whether the episode is done, optionally with the turn's
        reward (``(messages, done, reward)``: kept in ``Episode.turn_rewards`` and added to the episode's score);
        None: run the turn's tool calls (done when it makes none). ``message``: ``{"role": "assistant", "content":
        text}``, the turn's sampled ids decoded without special tokens. Runs on: the rollout's process."""
        return None

    def reward(self, episode: Episode) -> float | None:
        """The episode's score; None: the module's reward functions score it. May be ``async def`` (an LLM judge, a
        remote checker): the batch's episodes are then scored at once, in one event loop. Runs on: the rollout's
        process."""
        return None


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, Mapping) and "role" in m for m in value)


class ToolEnvironment(Environment):
    """The common case: the model calls ``tools`` until it answers without a call. ``ToolEnvironment(tools=[calculator],
    system_prompt=...)`` or a subclass with ``tools = [...]``."""

    def __init__(self, tools: Sequence[Callable[..., Any]] | None = None, system_prompt: str | None = None) -> None:
        if tools is not None:
            self.tools = list(tools)
        if system_prompt is not None:
            self.system_prompt = system_prompt


_NOT_RESET_COLUMNS = frozenset({"prompt", "environment"})
"""Columns a TRL-style ``reset(**columns)`` does not get: the prompt (the trainer's) and the environment's name
(TRL's trainer consumes it)."""


class _TRLStyle(Environment):
    """A TRL ``environment_factory`` instance as an :class:`Environment` (TRL >= 1.9): ``reset(**columns)`` gets the
    row's other columns; its text is appended to the row's last user message, or is the prompt when the row has
    none; its public methods are tools, ``get_reward()`` is the reward."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.tools = [
            getattr(inner, name)
            for name, _ in inspect.getmembers(type(inner), inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "get_reward")
        ]
        self.in_process = True

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        extra = self.inner.reset(**{k: v for k, v in row.items() if k not in _NOT_RESET_COLUMNS})
        if extra is not None and not isinstance(extra, str):
            raise ValueError(
                f"{type(self.inner).__name__}.reset(**columns) returned a {type(extra).__name__}; a TRL-style "
                "environment returns None or text (the prompt, or what to append to the row's last user message)."
            )
        prompt = row.get("prompt")
        if not any(_is_chat(v) for v in row.values()) and not (isinstance(prompt, str) and prompt.strip()):
            if not extra or not extra.strip():  # the environment owns the task: its text is the prompt
                raise ValueError(
                    f"{type(self.inner).__name__}.reset(**columns) returned {extra!r} for a row without a prompt "
                    f"(columns: {sorted(row)}). HINT: return the task's text from reset(), or give the dataset a "
                    "'prompt' column."
                )
            return super().reset({"prompt": extra})
        messages = super().reset(row)
        if extra:
            last = next(m for m in reversed(messages) if m.get("role") == "user")
            last["content"] = f"{last['content']}{extra}"
        return messages

    def reward(self, episode: Episode) -> Any:
        get_reward = getattr(self.inner, "get_reward", None)
        value = None if get_reward is None else get_reward()
        if inspect.isawaitable(value):  # an ``async def get_reward``: awaited with the batch's others

            async def score() -> float | None:
                got = await value
                return None if got is None else float(got)

            return score()
        return None if value is None else float(value)


def as_environment(obj: Any) -> Environment:
    """``obj`` as an :class:`Environment`: itself, or a TRL-style instance wrapped. Runs on: the rollout's process.
    Raises ValueError for an object that is neither."""
    if isinstance(obj, Environment):
        return obj
    if callable(getattr(obj, "reset", None)):
        return _TRLStyle(obj)
    raise ValueError(
        f"environment: {type(obj).__name__} has no reset(). HINT: subclass lightning_rlhf.agents.Environment "
        "(reset, step, reward), use ToolEnvironment(tools=[...]), or give a TRL-style class with reset(**row)."
    )


ENVIRONMENT_COLUMN = "environment"
"""The dataset column that names each row's environment when the module has several (TRL's multi-environment
column; verl names a row's interaction in its ``interaction_kwargs``)."""


class EnvironmentChoice:
    """Several environments by name: each episode gets the one its row's ``environment`` column names. Made by
    :func:`environment_factory` from ``environment={"name": ..., ...}``. Runs on: the rollout's process."""

    def __init__(self, factories: Mapping[str, Callable[[], Environment]]) -> None:
        self.factories = dict(factories)

    def __call__(self, row: Mapping[str, Any] | None = None) -> Environment:
        names = sorted(self.factories)
        name = None if row is None else row.get(ENVIRONMENT_COLUMN)
        if name not in self.factories:
            got = "no 'environment' column" if row is None or ENVIRONMENT_COLUMN not in row else f"{name!r}"
            raise ValueError(
                f"RLHFModule(environment={{{', '.join(map(repr, names))}: ...}}) picks each row's environment by its "
                f"'environment' column; this row has {got}. HINT: give every dataset row an 'environment' column "
                f"naming one of {names}."
            )
        return self.factories[name]()


def environment_factory(environment: Any) -> Callable[..., Environment]:
    """A callable making one :class:`Environment` per episode (given the episode's dataset row) from what the user
    gave: a class, a factory function, an instance (a :class:`ToolEnvironment` holds no episode state, so one
    instance may serve every episode: it is copied), or a mapping of names to those, each row's ``environment``
    column choosing (:class:`EnvironmentChoice`). Runs on: any process (the controller checks it before training)."""
    if isinstance(environment, Mapping):
        if not environment:
            raise ValueError("environment={}: no environment. HINT: name at least one, or pass environment=None.")
        return EnvironmentChoice({str(k): environment_factory(v) for k, v in environment.items()})
    if isinstance(environment, Environment):
        import copy

        return lambda row=None: copy.copy(environment)
    if callable(environment):
        return lambda row=None: as_environment(environment())
    raise ValueError(
        f"environment={environment!r}: expected an Environment subclass, a factory, or an instance. HINT: "
        "environment=ToolEnvironment(tools=[my_tool])."
    )


def scores_episodes(environment: Any) -> bool:
    """Whether ``environment`` (a class, an instance or a factory) scores its episodes itself: an
    :class:`Environment` that overrides ``reward``, or a TRL-style class with ``get_reward``. A factory function is
    called once to see; of several environments by name, all must score or none (a mix would leave some episodes
    without a score). Runs on: every process, when the module is built."""
    if isinstance(environment, Mapping):
        scored = {name: scores_episodes(env) for name, env in environment.items()}
        if len(set(scored.values())) > 1:
            raise ValueError(
                f"environment={{...}}: {sorted(n for n, s in scored.items() if s)} score their episodes (reward) and "
                f"{sorted(n for n, s in scored.items() if not s)} do not, so some episodes would have no score. "
                "HINT: give every environment a reward(episode), or none (the module's reward functions then score "
                "every episode)."
            )
        return any(scored.values())
    if not isinstance(environment, type) and not isinstance(environment, Environment) and callable(environment):
        environment = environment()
    cls = environment if isinstance(environment, type) else type(environment)
    if issubclass(cls, Environment):
        return cls.reward is not Environment.reward
    return callable(getattr(cls, "get_reward", None))


def environment_reward(prompts: list[str], completions: list[str], env_reward: list[float], **_: Any) -> list[float]:
    """The environment's score of each episode (the ``env_reward`` column the rollout wrote), as a reward function:
    ``RLHFModule(environment=...)`` adds it as the reward component ``environment``. Runs on: the scoring worker,
    in its own process (it only reads a column)."""
    bad = [i for i, r in enumerate(env_reward) if r is None or r != r]
    if bad:
        raise ValueError(
            f"the environment's reward(episode) returned None for {len(bad)} of {len(env_reward)} episodes (first: "
            f"{completions[bad[0]][:200]!r}). HINT: return a float for every episode, or leave reward() to the "
            "module's reward functions."
        )
    return [float(r) for r in env_reward]


setattr(environment_reward, IN_PROCESS, True)


def resolve_environment(environment: Any) -> Any:
    """``environment`` as given to the module, an import path (``"package.module.Name"``, as recipes write it)
    imported. Runs on: every process, when the module is built. Raises ValueError for a path that does not import.
    """
    if isinstance(environment, Mapping):  # several, by name: each resolved
        return {name: resolve_environment(env) for name, env in environment.items()}
    if not isinstance(environment, str):
        return environment
    import importlib

    module_name, _, name = environment.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(
            f"RLHFModule(environment={environment!r}) does not import ({type(err).__name__}: {err}). HINT: give "
            "the dotted path of an Environment class in an importable module, e.g. 'my_task.CalculatorEnv'."
        ) from err


def with_environment_reward(reward: Any, environment: Any) -> Any:
    """The module's reward with the environment's as the component ``environment`` when the environment scores
    its episodes (:func:`scores_episodes`). Runs on: every process, when the module is built. Raises ValueError
    when neither gives a reward."""
    if environment is None or not scores_episodes(environment):
        if reward is None:
            hint = " or an environment whose reward(episode) scores it" if environment is not None else ""
            raise ValueError(f"RLHFModule(reward=None): the module has no reward. HINT: pass reward=fn{hint}.")
        return reward
    if reward is None or isinstance(reward, Mapping):
        named = dict(reward or {})
    elif isinstance(reward, str):
        named = {"model": reward}
    else:
        named = {getattr(reward, "__name__", "reward"): reward}
    if "environment" in named:
        raise ValueError(
            "RLHFModule(reward={'environment': ...}): the name 'environment' is the environment's own reward. "
            "HINT: name that component otherwise."
        )
    return {**named, "environment": environment_reward}
