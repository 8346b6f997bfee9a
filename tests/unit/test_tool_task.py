"""The embedded tool task: its calculator, data, transcripts (SFT with tool turns, loss on the assistant turns
only) and the tool template's round trip through the Hermes parser."""

from __future__ import annotations

import datasets
import pytest

from lightning_rlhf.agents.parsing import parse_hermes
from lightning_rlhf.agents.tokens import check_chat_template
from lightning_rlhf.agents.tools import ToolSet
from lightning_rlhf.data.sft import encode_chat
from lightning_rlhf.demo.tiny import build_tiny_tokenizer
from lightning_rlhf.demo.tool_task import (
    TOOL_CHAT_TEMPLATE,
    CalculatorEnvironment,
    Episode,
    NoToolEnvironment,
    calculator,
    final_answer,
    tool_splits,
    tool_transcripts,
)


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return tokenizer


def test_calculator_adds_and_refuses_what_is_not_integer_arithmetic() -> None:
    assert calculator("482+397") == "879"
    assert calculator(" 12*(3-1) ") == "24" and calculator("-5+2") == "-3"
    for bad in ("__import__('os')", "2**10", "1/2", "3.5+1", "x+1", "1+", "1" * 101):
        with pytest.raises(ValueError):
            calculator(bad)


def test_the_splits_are_disjoint_three_digit_sums() -> None:
    splits = tool_splits()
    train, test = splits["train"], splits["test"]
    assert (len(train), len(test)) == (400, 64)
    assert not set(train["prompt"]) & set(test["prompt"])
    for prompt, answer in zip(train["prompt"], train["answer"], strict=True):
        a, b = prompt.rstrip("=").split("+")
        assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999 and int(answer) == int(a) + int(b)
    assert tool_splits()["test"]["prompt"] == test["prompt"]  # the same split in every process


def test_sft_on_tool_transcripts_trains_the_assistant_turns_only(tok) -> None:
    rows = tool_transcripts(tool_splits()["train"].select(range(3)), with_tool=True)
    rows += tool_transcripts(tool_splits()["train"].select(range(3)), with_tool=False)
    table = datasets.Dataset.from_list(rows)  # as SFTDataModule reads them: Arrow fills absent keys with None
    for i, row in enumerate(rows):
        ids, mask = encode_chat(tok, row["messages"], tools=row["tools"])
        assert (ids, mask) == encode_chat(tok, table[i]["messages"], tools=table[i]["tools"])
        text = tok.decode(ids)
        assert text == tok.apply_chat_template(row["messages"], tools=row["tools"], tokenize=False)
        answer = row["messages"][-1]["content"]
        trained = tok.decode([t for t, m in zip(ids, mask, strict=True) if m])
        if row["tools"]:
            assert "tools: calculator" in text and "tools" not in trained  # the tool list is context
            expression = row["messages"][0]["content"].rstrip("=")
            call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'
            assert trained == f"{call}</s>{answer}</s>"  # the call and the answer; the tool's result is context
        else:
            assert "tools" not in text and trained == f"{answer}</s>"


def test_the_template_writes_calls_the_parser_reads_and_renders_tool_turns(tok) -> None:
    row = tool_transcripts(tool_splits()["test"].select(range(1)), with_tool=True)[0]
    rendered = tok.apply_chat_template(row["messages"][:2], tools=row["tools"], tokenize=False)
    turn = rendered.split("<|assistant|>\n")[1].split("</s>")[0]
    (call,) = parse_hermes(turn).calls
    assert call.error is None and call.name == "calculator"
    assert ToolSet([calculator]).check(call) is None
    assert calculator(**call.arguments) == row["messages"][2]["content"]
    check_chat_template(tok, tools=row["tools"])  # renders tool turns; prefix-preserving


def test_the_environments_score_the_final_answer() -> None:
    row = {"prompt": "482+397=", "answer": "879"}
    episode = Episode(row=row, messages=[{"role": "user", "content": "482+397="}])
    episode.messages += [
        {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "482+397"}}'},
        {"role": "tool", "name": "calculator", "content": "879"},
    ]
    assert final_answer(episode) == "" and CalculatorEnvironment().reward(episode) == 0.0  # ended on a call
    episode.messages.append({"role": "assistant", "content": " 879"})
    assert CalculatorEnvironment().reward(episode) == 1.0 and NoToolEnvironment().reward(episode) == 1.0
    episode.messages[-1]["content"] = "878"
    assert CalculatorEnvironment().reward(episode) == 0.0
    plain = NoToolEnvironment()
    assert plain.reset(row) == [{"role": "user", "content": "482+397="}] and not plain.tools
    assert plain.step({"role": "assistant", "content": "879"}) == ([], True)
