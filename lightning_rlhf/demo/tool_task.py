"""The demo's tool task: three-digit addition ("482+397=" -> "879") with a ``calculator`` tool.

The demo-sized model cannot add three-digit numbers in one turn (it sees too few of the 810,000 sums to learn
the carries), but it can copy digits: call ``calculator`` with the expression, read the result, answer with it.
A supervised warm start on tool-use transcripts teaches the format; RL with the tool then has to get the copying
right, and the same model without the tool shows what the tool is worth.

An episode with the tool, as the tool template renders it (tiny tokenizer, :data:`TOOL_CHAT_TEMPLATE`)::

    <s><|system|>
    tools: calculator</s>
    <|user|>
    482+397=</s>
    <|assistant|>
    <tool_call>{"name": "calculator", "arguments": {"expression": "482+397"}}</tool_call></s>
    <|tool|>
    879</s>
    <|assistant|>
    879</s>

Without the tool the template writes no ``tools`` line and the model answers at once.

Runs on: any process (plain functions and the environment classes; the environments run where the rollout runs)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning_rlhf.agents.env import Environment, Episode, ToolEnvironment
from lightning_rlhf.demo.calculator import calculator

if TYPE_CHECKING:
    import datasets

__all__ = [
    "TOOL_CHAT_TEMPLATE",
    "CalculatorEnvironment",
    "NoToolEnvironment",
    "calculator",
    "final_answer",
    "tool_splits",
    "tool_transcripts",
]

TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\ntools: "
    "{% for tool in tools %}{{ tool.function.name if tool.function is defined else tool.name }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] or '' }}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% set call = call.function if call.function is defined else call %}"
    '<tool_call>{"name": {{ call.name | tojson }}, "arguments": {{ call.arguments | tojson }}}</tool_call>'
    "{% endfor %}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""The tiny tokenizer's chat template (:data:`~lightning_rlhf.demo.tiny.CHAT_TEMPLATE`'s layout) with tools: the
tool names in a system turn when ``tools=`` is given (names only: the schemas would fill the tiny model's 256
positions), an assistant turn's ``tool_calls`` written Hermes-style (``<tool_call>{"name": ..., "arguments":
...}</tool_call>``, what :func:`~lightning_rlhf.agents.parsing.parse_hermes` reads) and ``tool`` turns as
``<|tool|>``. Prefix-preserving, like the template it extends."""

DIGITS = 3
"""Digits of each operand (100..999)."""


def tool_splits(*, train: int = 400, held_out: int = 64, seed: int = 0) -> datasets.DatasetDict:
    """Three-digit additions, drawn with ``seed`` without repeats: ``"train"`` (``train`` prompts, what the warm
    start and RL see) and ``"test"`` (``held_out`` others). Columns ``"prompt"`` (``"482+397="``) and
    ``"answer"`` (``"879"``). Runs on: any process (the same split on every rank)."""
    lo, hi = 10 ** (DIGITS - 1), 10**DIGITS
    count = (hi - lo) ** 2
    if train < 1 or held_out < 1 or train + held_out > count:
        raise ValueError(f"tool_splits(train={train}, held_out={held_out}): expected 1.. each, {count} in all.")
    codes = random.Random(seed).sample(range(count), train + held_out)
    pairs = [(lo + c // (hi - lo), lo + c % (hi - lo)) for c in codes]
    import datasets

    def table(part: list[tuple[int, int]]) -> datasets.Dataset:
        return datasets.Dataset.from_dict(
            {"prompt": [f"{a}+{b}=" for a, b in part], "answer": [str(a + b) for a, b in part]}
        )

    return datasets.DatasetDict({"train": table(pairs[:train]), "test": table(pairs[train:])})


def tool_transcripts(rows: datasets.Dataset, *, with_tool: bool) -> list[dict[str, Any]]:
    """SFT rows for the warm start, one per prompt: ``{"messages": [...], "tools": [schema] or None}``. With the
    tool: the user's sum, the assistant's ``calculator`` call, the tool's result, the assistant's answer (the
    loss falls on both assistant turns); without: the user's sum and the answer. Runs on: any process."""
    from lightning_rlhf.agents.tools import tool_schema

    schema = [tool_schema(calculator)] if with_tool else None
    out = []
    for prompt, answer in zip(rows["prompt"], rows["answer"], strict=True):
        user = {"role": "user", "content": prompt}
        if with_tool:
            call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": prompt[:-1]}}}
            messages = [
                user,
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": answer},
                {"role": "assistant", "content": answer},
            ]
        else:
            messages = [user, {"role": "assistant", "content": answer}]
        out.append({"messages": messages, "tools": schema})
    return out


def final_answer(episode: Episode) -> str:
    """The text of the episode's last assistant turn (empty when it ended on a tool call). Runs on: any process."""
    for message in reversed(episode.messages):
        if message.get("role") == "assistant":
            return "" if "<tool_call>" in str(message.get("content")) else str(message.get("content", "")).strip()
    return ""


def _exact(episode: Episode) -> float:
    return 1.0 if final_answer(episode) == str(episode.row["answer"]).strip() else 0.0


class CalculatorEnvironment(ToolEnvironment):
    """The tool task's environment: the prompt as the user's turn, ``calculator`` as the tool, reward 1.0 when the
    final answer is the sum. Runs on: the rollout's process (one instance per episode)."""

    tools = (calculator,)

    def reward(self, episode: Episode) -> float:
        """1.0 for the exact sum as the last answer, else 0.0. Runs on: the rollout's process."""
        return _exact(episode)


class NoToolEnvironment(Environment):
    """The same task without the tool: one turn, the model adds by itself. Runs on: the rollout's process."""

    def reset(self, row: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The prompt as the user's turn. Runs on: the rollout's process."""
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, message: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
        """Done after the first answer (a tool call gets no result). Runs on: the rollout's process."""
        return [], True

    def reward(self, episode: Episode) -> float:
        """1.0 for the exact sum, else 0.0. Runs on: the rollout's process."""
        return _exact(episode)
