"""Agents for real models: the chat template's extra arguments reach every render, the
episode's rendered prompt is what ``max_prompt_length`` bounds, TRL >= 1.9's ``environment_factory`` semantics,
per-turn rewards, tool errors by kind in metrics and the log, and observations that overflow the context.

The engine is the scripted stand-in of tests/scripted.py; the data modules run their ``setup`` against a
stand-in trainer (the module's tokenizer and environment factory), as Lightning calls it before any model loads.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import datasets
import pytest

from lightning_rlhf.agents import Environment, Episode, ToolEnvironment
from lightning_rlhf.agents.env import environment_factory, environment_reward, with_environment_reward
from lightning_rlhf.agents.rollout import episode_metrics
from lightning_rlhf.config import EpisodeConfig, RolloutConfig
from lightning_rlhf.data import PromptDataModule
from lightning_rlhf.data.sft import SFTDataModule, encode_chat
from lightning_rlhf.demo.tiny import build_tiny_tokenizer
from lightning_rlhf.demo.tool_task import TOOL_CHAT_TEMPLATE
from lightning_rlhf.roles.base import EpisodesMixin
from lightning_rlhf.roles.reward import RewardRole
from tests.agent_tools import calculator, dies, flood, sleepy, unreadable
from tests.scripted import ScriptedEngine, run

NO_THINK = "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
# The demo's tool template, reading `enable_thinking` (as Qwen3's does) at the start of every render and in every
# tool turn: a render that did not get the argument shows no "/no_think".
THINKING_TEMPLATE = (
    "{{ bos_token }}"
    + NO_THINK
    + TOOL_CHAT_TEMPLATE.removeprefix("{{ bos_token }}").replace(
        "<|{{ message['role'] }}|>\n",
        "<|{{ message['role'] }}|>\n{% if message['role'] == 'tool' %}" + NO_THINK + "{% endif %}",
    )
)
KWARGS = {"enable_thinking": False}


def thinking_tokenizer():
    tok = build_tiny_tokenizer()
    tok.chat_template = THINKING_TEMPLATE
    return tok


def stand_in_trainer(tok, environment=None, max_steps: int = 5):
    actor = EpisodesMixin()  # what the module's actor is to the data module: it owns the environment
    actor.environment = None if environment is None else environment_factory(environment)
    return SimpleNamespace(lightning_module=SimpleNamespace(tokenizer=tok, actor=actor), max_steps=max_steps)


def set_up(dm, tok, environment=None, max_steps: int = 5):
    dm.trainer = stand_in_trainer(tok, environment, max_steps)
    dm.setup("fit")
    return dm


# ------------------------------------------------------------------------------------------------ item 10
def test_chat_template_kwargs_reach_prompts_episodes_sft_and_reward_models() -> None:
    tok = thinking_tokenizer()
    rows = datasets.Dataset.from_dict({"prompt": ["37*41=?"] * 2})
    # prompts
    dm = set_up(PromptDataModule(rows, batch_size=2, chat_template=True, chat_template_kwargs=KWARGS), tok)
    batch = next(iter(dm.train_dataloader()))
    assert tok.decode(batch["prompts"][0][batch["prompt_mask"][0].bool()]).startswith("<s>/no_think <|user|>")
    plain = set_up(PromptDataModule(rows, batch_size=2, chat_template=True), tok)
    assert "/no_think" not in tok.decode(next(iter(plain.train_dataloader()))["prompts"][0])
    # episodes: the prompt and every observation (the tool turn) render with them
    batch.meta["chat_template_kwargs"] = KWARGS
    episodes, _ = run(tok, ToolEnvironment(tools=[calculator]), RolloutConfig(max_new_tokens=128), batch=batch)
    prompt = tok.decode(episodes["prompts"][0][episodes["prompt_mask"][0].bool()])
    assert prompt.startswith("<s>/no_think <|system|>\ntools: calculator")
    after = tok.decode(episodes["responses"][0][episodes["response_mask"][0].bool()])
    assert "<|tool|>\n/no_think 1517</s>" in after
    # SFT examples
    sft_rows = datasets.Dataset.from_dict({"prompt": ["3+4="] * 2, "answer": ["7"] * 2})
    sft = SFTDataModule(sft_rows, batch_size=2, chat_template=True, chat_template_kwargs=KWARGS)
    example = next(iter(set_up(sft, tok).train_dataloader()))
    assert tok.decode(example["input_ids"][0]).startswith("<s>/no_think <|user|>\n3+4=")
    # a reward model that renders the chat
    stand_in = SimpleNamespace(_model_tokenizer=tok, path="rm")
    meta = {"chat_prompt": True, "messages_column": None, "chat_template_kwargs": KWARGS}
    texts, _ = RewardRole._model_texts(stand_in, SimpleNamespace(meta=meta), ["3+4="], ["7"])
    assert texts[0].startswith("<s>/no_think <|user|>\n3+4=")


def test_chat_template_kwargs_must_be_a_dict_of_names() -> None:
    with pytest.raises(ValueError, match=r"chat_template_kwargs=\['enable_thinking'\].*HINT"):
        PromptDataModule("x.jsonl", chat_template_kwargs=["enable_thinking"])


class Verbose(ToolEnvironment):
    tools = (calculator,)
    system_prompt = "You are a careful assistant. " * 20  # about 600 characters: far more than the row's prompt


def test_max_prompt_length_bounds_the_rendered_episode_prompt() -> None:
    tok = build_tiny_tokenizer()
    rows = datasets.Dataset.from_dict({"prompt": ["1+2=", "3+4="]})
    assert len(tok("1+2=")["input_ids"]) < 20  # the row's prompt alone fits ...
    with pytest.raises(
        ValueError, match=r"row 0 has \d+ tokens in its episode's first prompt .* > max_prompt_length=64"
    ):
        set_up(PromptDataModule(rows, batch_size=1, max_prompt_length=64, overlong="error"), tok, Verbose)
    with pytest.raises(ValueError, match=r"0 prompts left after filtering"):  # ... the rendered episode does not
        set_up(PromptDataModule(rows, batch_size=1, max_prompt_length=64), tok, Verbose)
    dm = set_up(PromptDataModule(rows, batch_size=2, max_prompt_length=1024), tok, Verbose)
    batch = next(iter(dm.train_dataloader()))
    episodes, _ = run(tok, Verbose, RolloutConfig(max_new_tokens=128), batch=batch)
    assert batch["prompts"].shape[1] == episodes["prompts"].shape[1] > 64  # what was measured is what runs
    # an episode whose prompt only reset() decides (no dataset row determines it) is refused at the rollout
    batch.meta["max_prompt_length"] = 64
    with pytest.raises(ValueError, match=r"first prompt .* > PromptDataModule\(max_prompt_length=64\).*HINT"):
        run(tok, Verbose, RolloutConfig(max_new_tokens=128), batch=batch)


def test_the_docs_state_the_tool_demos_steps() -> None:
    from lightning_rlhf.demo.job import TASK_DEFAULTS

    page = (Path(__file__).parents[2] / "docs" / "agents.md").read_text(encoding="utf-8")
    section = page.split("## The embedded tool task")[1].split("\n## ")[0]
    assert f"for {TASK_DEFAULTS['tools']['steps']} steps" in section


# ------------------------------------------------------------------------------------------------ item 11
class IncrementEnv:  # as TRL's docs (GRPOTrainer, "Training with environments") show it
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def increments(text: str) -> str:
    """Calls increment with the episode's target, then answers."""
    if "<|tool|>" in text:
        return "Done."
    target = text.split("Increment the counter by ")[-1][0]
    return f'<tool_call>{{"name": "increment", "arguments": {{"step": {target}}}}}</tool_call>'


def test_a_trl_environment_without_a_dataset_makes_its_own_prompts() -> None:
    tok = build_tiny_tokenizer()
    dm = set_up(PromptDataModule(None, batch_size=4), tok, IncrementEnv)
    batch = next(iter(dm.train_dataloader()))
    assert batch["prompt"] == [""] * 4
    engine = ScriptedEngine(tok, script=increments)
    episodes, _ = run(tok, IncrementEnv, RolloutConfig(max_new_tokens=128), batch=batch, engine=engine)
    for messages, prompt in zip(episodes["episode"], episodes["prompt"], strict=True):
        assert messages[0] == {"role": "user", "content": prompt} and prompt.startswith("Increment the counter by ")
        assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert episodes["env_reward"] == [1.0] * 4  # get_reward: the counter reached each episode's own target
    with pytest.raises(ValueError, match=r"Trainer\(max_steps=\.\.\.\)"):
        set_up(PromptDataModule(None, batch_size=4), tok, IncrementEnv, max_steps=-1)
    with pytest.raises(ValueError, match=r"train=None.*no environment"):
        set_up(PromptDataModule(None, batch_size=4), tok)


class Coding:
    seen: ClassVar[list[dict]] = []

    def reset(self, **kwargs) -> str:
        Coding.seen.append(kwargs)
        return "Compute the 7th Fibonacci number."

    def run_code(self, code: str) -> str:
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.
        """
        return "13"


class Game:
    def reset(self, **kwargs) -> str:
        return "Reach the goal tile."

    def move(self, action: str) -> str:
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down", "left", "right".
        """
        return "moved"


def test_a_dataset_of_only_an_environment_column_routes_and_reset_gives_the_prompt() -> None:
    tok = build_tiny_tokenizer()
    rows = datasets.Dataset.from_dict({"environment": ["coding", "game"] * 2, "level": [1, 2, 3, 4]})
    envs = {"coding": Coding, "game": Game}
    dm = set_up(PromptDataModule(rows, batch_size=4, shuffle=False), tok, envs)
    batch = next(iter(dm.train_dataloader()))
    Coding.seen.clear()
    episodes, _ = run(tok, envs, RolloutConfig(max_new_tokens=64), batch=batch)
    assert [m[0]["content"] for m in episodes["episode"]] == [
        "Compute the 7th Fibonacci number.",
        "Reach the goal tile.",
    ] * 2
    assert Coding.seen == [{"level": 1}, {"level": 3}]  # the row's other columns; neither prompt nor environment


class TargetEnv:  # TRL's docs, with a dataset: the prompt column is the prompt, the other columns reach reset
    def reset(self, target, **kwargs) -> None:
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """Increment the internal counter.

        Args:
            step: Value to add to the counter.
        """
        self.counter += step
        return self.counter


def test_a_trl_environment_with_a_dataset_keeps_the_rows_prompt() -> None:
    tok = build_tiny_tokenizer()
    rows = datasets.Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Increment the counter by {i}."}] for i in (2, 5)], "target": [2, 5]}
    )
    dm = set_up(PromptDataModule(rows, batch_size=2, messages_column="prompt", shuffle=False), tok, TargetEnv)
    batch = next(iter(dm.train_dataloader()))
    engine = ScriptedEngine(tok, script=increments)
    episodes, _ = run(tok, TargetEnv, RolloutConfig(max_new_tokens=128), batch=batch, engine=engine)
    assert [m[0]["content"] for m in episodes["episode"]] == [
        "Increment the counter by 2.",
        "Increment the counter by 5.",
    ]
    assert episodes["env_reward"] == [1.0, 1.0]


# ------------------------------------------------------------------------------------------------ item 12
class Stairs(Environment):
    """Three user turns; each assistant turn earns 0.25 (verl's interaction reward); the episode's own score 1."""

    def step(self, message):
        done = self.turns_seen = getattr(self, "turns_seen", 0) + 1
        return [{"role": "user", "content": "again"}], done >= 3, 0.25

    def reward(self, episode: Episode) -> float:
        return 1.0


def test_per_turn_rewards_are_added_to_the_episodes_score_that_the_reward_uses() -> None:
    tok = build_tiny_tokenizer()
    engine = ScriptedEngine(tok, script=lambda text: "ok")
    batch, _ = run(tok, Stairs, RolloutConfig(max_new_tokens=16, episode=EpisodeConfig(max_turns=5)), engine=engine)
    assert batch["turn_rewards"] == [[0.25, 0.25, 0.25]] and batch["env_reward"] == [1.75]
    assert episode_metrics(batch)["rollout/turn_rewards/mean"] == 0.75
    reward = with_environment_reward(None, Stairs)  # the module's reward: the environment's component
    assert reward == {"environment": environment_reward}
    assert environment_reward(batch["prompt"], ["ok"], batch["env_reward"]) == [1.75]  # what the advantages get

    class Unscored(Environment):
        def step(self, message):
            return [], True, 0.5

    with pytest.raises(ValueError, match=r"Unscored.step returned per-turn rewards, but .* no reward\(episode\).*HINT"):
        run(tok, Unscored, RolloutConfig(max_new_tokens=16), engine=ScriptedEngine(tok, script=lambda text: "ok"))

    class BadReward(Environment):
        def step(self, message):
            return [], True, "good"

        def reward(self, episode):
            return 0.0

    with pytest.raises(ValueError, match=r"turn reward 'good'; expected a finite number"):
        run(tok, BadReward, RolloutConfig(max_new_tokens=16), engine=ScriptedEngine(tok, script=lambda text: "ok"))


def test_tool_errors_are_counted_by_kind_and_the_first_of_each_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    tok = build_tiny_tokenizer()
    calls = {
        "a": ['<tool_call>{"name": "search", "arguments": {}}</tool_call>', "<tool_call>{not json</tool_call>"],
        "b": ['<tool_call>{"name": "calculator", "arguments": {"expression": "import os"}}</tool_call>'],
        "c": ['<tool_call>{"name": "sleepy", "arguments": {"seconds": 30}}</tool_call>'],
        "d": ['<tool_call>{"name": "unreadable", "arguments": {}}</tool_call>'],
        "e": ['<tool_call>{"name": "dies", "arguments": {}}</tool_call>'],
    }

    def script(text: str) -> str:
        name = text.split("<|user|>\n")[1][0]
        done = text.count("<|tool|>")
        return calls[name][done] if done < len(calls[name]) else "stop"

    env = ToolEnvironment(tools=[calculator, sleepy, unreadable, dies])
    cfg = RolloutConfig(max_new_tokens=128, episode=EpisodeConfig(max_turns=4, tool_timeout_s=2, tool_workers=2))
    with caplog.at_level(logging.WARNING, logger="lightning_rlhf"):
        batch, _ = run(tok, env, cfg, texts=list(calls), engine=ScriptedEngine(tok, script=script))
        metrics = episode_metrics(batch)
    assert {k: v for k, v in metrics.items() if k.startswith("rollout/tool_errors")} == {
        "rollout/tool_errors": 6.0,
        "rollout/tool_errors/malformed": 2.0,
        "rollout/tool_errors/raised": 1.0,
        "rollout/tool_errors/timeout": 1.0,
        "rollout/tool_errors/crash": 1.0,
        "rollout/tool_errors/invalid_result": 1.0,
    }
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("lightning_rlhf")]
    assert len(warned) == 5  # one per kind, the first of each
    assert any("(malformed) in 1 of 5 episodes; first: " in w and "no tool named 'search'" in w for w in warned)
    assert any("(timeout)" in w and "timed out after 2 s" in w for w in warned)
    assert any("(raised)" in w and "not arithmetic" in w for w in warned)


def test_a_cut_result_that_still_overflows_is_counted_and_warned(caplog: pytest.LogCaptureFixture) -> None:
    tok = build_tiny_tokenizer()
    big = '<tool_call>{"name": "flood", "arguments": {"size": 1000000}}</tool_call>'
    engine = ScriptedEngine(tok, script=lambda text: "Done." if "<|tool|>" in text else big)
    cfg = RolloutConfig(
        max_new_tokens=96, episode=EpisodeConfig(max_turns=3, max_episode_tokens=600)
    )  # 2,000 characters will not fit
    with caplog.at_level(logging.WARNING, logger="lightning_rlhf"):
        batch, _ = run(tok, ToolEnvironment(tools=[flood]), cfg, texts=["a", "b"], engine=engine)
        metrics = episode_metrics(batch)
    assert batch["response_truncated"].tolist() == [True, True]
    assert metrics["rollout/observation_overflow"] == 2.0 and metrics["rollout/tool_errors"] == 0.0
    (warning,) = [r.getMessage() for r in caplog.records if "did not fit" in r.getMessage()]
    assert warning.startswith("2 of 2 episodes ended truncated because an observation did not fit")
    assert "max_tool_response_chars=2000" in warning and "HINT" in warning


def test_sft_data_with_tool_turns_as_datasets_store_them(tmp_path: Path) -> None:
    tok = build_tiny_tokenizer()
    tok.chat_template = TOOL_CHAT_TEMPLATE
    schema = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "482+397"}}}
    messages = [
        {"role": "user", "content": "482+397="},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": "879"},
        {"role": "assistant", "content": "879"},
    ]
    expected = encode_chat(tok, messages, tools=[schema])
    # as a .jsonl written by another tool stores them: arguments and tools as JSON text, no content on a call
    stored = json.loads(json.dumps(messages))
    stored[1] = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": json.dumps({"expression": "482+397"})}}
    ]}  # fmt: skip
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": stored, "tools": json.dumps([schema])}) + "\n")
    dm = set_up(SFTDataModule(str(path), batch_size=1, messages_column="messages"), tok)
    example = next(iter(dm.train_dataloader()))
    assert example["input_ids"][0].tolist() == expected[0] and example["loss_mask"][0].tolist() == expected[1]
    trained = tok.decode([t for t, m in zip(*expected, strict=True) if m])
    assert trained == '<tool_call>{"name": "calculator", "arguments": {"expression": "482+397"}}</tool_call></s>879</s>'
