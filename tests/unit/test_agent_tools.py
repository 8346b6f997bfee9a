"""Tools for agentic rollouts: schemas from signatures, the Hermes parser, the checks before a call runs, and the
executor that runs tools in worker processes with a timeout (a tool that raises, hangs, crashes or returns an
object with no text form gives an error observation, never an exception or a stall)."""

from __future__ import annotations

import pytest

from lightning_rlhf.agents.parsing import ParsedTurn, ToolCall, get_tool_parser, parse_hermes, register_tool_parser
from lightning_rlhf.agents.tools import ToolSet, tool_schema
from lightning_rlhf.sandbox.tools import ToolExecutor
from tests.agent_tools import (
    async_dies,
    async_raises,
    async_unreadable,
    blocks_the_loop,
    calculator,
    dies,
    gather_up,
    nap,
    power,
    sleepy,
    unreadable,
)


def test_schemas_come_from_signatures_and_docstrings() -> None:
    schema = tool_schema(power)["function"]
    assert schema["name"] == "power" and schema["description"] == "Raise a number to a power."
    assert schema["parameters"]["properties"]["base"] == {"type": "integer", "description": "the number."}
    assert schema["parameters"]["required"] == ["base"]

    def no_doc(x: int) -> int:
        return x

    with pytest.raises(ValueError, match=r"tool 'no_doc': its JSON schema cannot be made .*HINT: a tool is a plain"):
        tool_schema(no_doc)
    with pytest.raises(ValueError, match=r"two tools are named 'power'"):
        ToolSet([power, power])


def test_hermes_calls_prose_and_malformed_calls() -> None:
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>'
    turn = parse_hermes(text)
    assert turn.content == "Let me compute."
    assert turn.calls == (ToolCall("calculator", {"expression": "3*4"}, raw=turn.calls[0].raw),)
    two = parse_hermes('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call><tool_call>{bad</tool_call>')
    assert two.calls[0].name == "a" and two.calls[0].arguments == {"x": 1}  # arguments as a JSON string
    assert two.calls[1].error is not None and "not valid JSON" in two.calls[1].error
    assert (
        parse_hermes('<tool_call>{"arguments": {}}</tool_call>')
        .calls[0]
        .error.startswith('the tool call needs a "name"')
    )
    cut = parse_hermes('<tool_call>{"name": "a", "arguments": {}}')  # the budget ended the turn inside the call
    assert cut.calls[0].error == "the tool call has no </tool_call>"
    assert parse_hermes("The answer is 12.").calls == ()


def test_parser_registry_names_the_known_formats() -> None:
    register_tool_parser(
        "bracket", lambda text: parse_hermes(text.replace("[[", "<tool_call>").replace("]]", "</tool_call>"))
    )
    turn = get_tool_parser("bracket")('[[{"name": "power", "arguments": {"base": 3}}]]')
    assert turn.calls[0].arguments == {"base": 3}
    with pytest.raises(
        ValueError, match=r"tool_parser='xml'\) is not a registered format \(known: 'auto', 'template', 'bracket', 'h"
    ):
        get_tool_parser("xml")


# A response template (transformers' description of how a model writes its reply) for JSON calls without tags, in the
# shape Llama 3.x writes them: what Hermes' tags never find.
JSON_CALLS = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {
            "open_pattern": r'\{"name":\s*"(?P<name>[^"]+)",\s*"parameters":\s*',
            "close_pattern": r"\}<\|im_end\|>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def test_a_tokenizers_response_template_reads_the_calls() -> None:
    from lightning_rlhf.agents.parsing import parse_with_template, resolve_tool_parser
    from tests.scripted import qwen_style_tokenizer

    tok = qwen_style_tokenizer()
    assert resolve_tool_parser("auto", tok) == "hermes"
    with pytest.raises(ValueError, match=r"tool_parser='template'\) reads calls with the tokenizer's response_temp"):
        resolve_tool_parser("template", tok)
    tok.response_template = JSON_CALLS
    assert resolve_tool_parser("auto", tok) == "template" and resolve_tool_parser("hermes", tok) == "hermes"
    prefix = tok.apply_chat_template(
        [{"role": "user", "content": "3^2?"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )

    def parse(text: str):
        return parse_with_template(tok, tok.encode(text, add_special_tokens=False), prefix[-32:], [tool_schema(power)])

    call = parse('{"name": "power", "parameters": {"base": "3"}}<|im_end|>').calls
    assert [(c.name, c.arguments, c.error) for c in call] == [("power", {"base": 3}, None)]  # typed by the schema
    assert parse("It is 9.<|im_end|>") == ParsedTurn("It is 9.")
    (broken,) = parse('{"name": "power", "parameters": {"base": 3<|im_end|>').calls
    assert broken.error is not None and broken.error.startswith("the tool call cannot be read")
    assert parse_hermes('{"name": "power", "parameters": {"base": 3}}').calls == ()  # the format Hermes cannot see
    with pytest.raises(ValueError, match="'template' is reserved"):
        register_tool_parser("template", parse_hermes)


def test_calls_are_checked_before_they_run() -> None:
    tools = ToolSet([calculator, power])
    assert tools.check(ToolCall("power", {"base": 3})) is None
    assert tools.check(ToolCall("search", {})) == "there is no tool named 'search' (the tools: calculator, power)"
    assert "takes no argument 'x'" in tools.check(ToolCall("power", {"base": 3, "x": 1}))
    assert tools.check(ToolCall("power", {})) == "power needs the argument(s) 'base'"
    assert "'base' must be of type integer, got '3'" in tools.check(ToolCall("power", {"base": "3"}))
    assert "must be of type integer, got True" in tools.check(ToolCall("power", {"base": True}))
    assert tools.check(ToolCall("", error="the tool call is not valid JSON")) == "the tool call is not valid JSON"


def test_the_executor_survives_every_way_a_tool_can_fail() -> None:
    tools = {f.__name__: f for f in (calculator, power, sleepy, unreadable, dies)}
    executor = ToolExecutor(tools, timeout_s=1.0, num_workers=2, max_chars=20)
    try:
        ok = executor.submit(ToolCall("calculator", {"expression": "37 * 41"})).result()
        assert (ok.text, ok.kind) == ("1517", "ok")
        assert executor.submit(ToolCall("power", {"base": 3})).result().text == "9"  # JSON of a number
        raised = executor.submit(ToolCall("calculator", {"expression": "import os"})).result()
        assert raised.kind == "raised" and "ValueError: not arithmetic" in raised.text
        hung = executor.submit(ToolCall("sleepy", {"seconds": 60})).result()
        assert hung.kind == "timeout" and "timed out after 1 s" in hung.text
        bad = executor.submit(ToolCall("unreadable", {})).result()
        assert bad.kind == "invalid_result" and "cannot be written into a message" in bad.text
        crash = executor.submit(ToolCall("dies", {})).result()
        assert crash.kind == "crash" and "exit code 3" in crash.text
        long = executor.submit(ToolCall("calculator", {"expression": "7 ** 60"})).result()
        assert long.text.endswith("characters cut]") and long.text.startswith(str(7**60)[:20])
        # After a timeout and a crash, the replaced workers serve calls as before, two at once.
        both = [executor.submit(ToolCall("sleepy", {"seconds": 0.3})) for _ in range(2)]
        assert [f.result().text for f in both] == ["awake", "awake"]
    finally:
        executor.close()
    assert executor.started >= 4  # two first workers, a replacement for the hung one and for the dead one


def test_async_tools_run_side_by_side_in_one_worker() -> None:
    """Every call of an ``async def`` tool waits until all 12 are running: were they run one at a time, the first
    would wait until its timeout. They all run in the one coroutine worker, beside the plain tools' worker."""
    tools = {f.__name__: f for f in (gather_up, calculator)}
    executor = ToolExecutor(tools, timeout_s=60.0, num_workers=1)
    try:
        calls = [executor.submit(ToolCall("gather_up", {"count": 12})) for _ in range(12)]
        results = [f.result() for f in calls]
        assert [r.kind for r in results] == ["ok"] * 12 and {r.text for r in results} == {"12"}
        assert executor.submit(ToolCall("calculator", {"expression": "6*7"})).result().text == "42"
        assert executor.started == 2  # one worker for the plain tools, one for the coroutines
    finally:
        executor.close()


def test_async_tools_fail_into_observations_and_the_worker_recovers(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_rlhf.sandbox import tools as tools_module

    monkeypatch.setattr(tools_module, "_COROUTINE_GRACE_S", 10.0)  # a busy machine answers a cancel late
    tools = {f.__name__: f for f in (nap, blocks_the_loop, async_raises, async_unreadable, async_dies)}
    executor = ToolExecutor(tools, timeout_s=1.0, num_workers=1, max_chars=20)
    try:
        late = executor.submit(ToolCall("nap", {"seconds": 60})).result()
        assert late.kind == "timeout" and late.text == "error: the tool nap timed out after 1 s"
        raised = executor.submit(ToolCall("async_raises", {"text": "no luck"})).result()
        assert raised.kind == "raised" and raised.text == "error: the tool async_raises raised RuntimeError: no luck"
        bad = executor.submit(ToolCall("async_unreadable", {})).result()
        assert bad.kind == "invalid_result" and "cannot be written into a message" in bad.text
        assert executor.started == 1  # a cancelled coroutine costs no worker
        # A tool that blocks the loop cannot be cancelled: the worker is killed once the call is past its timeout
        # and the grace, and a call beside it fails with it.
        blocked = executor.submit(ToolCall("blocks_the_loop", {"seconds": 60}))
        beside = executor.submit(ToolCall("nap", {"seconds": 0.01}))
        assert blocked.result().kind == "timeout"
        assert beside.result().kind in ("timeout", "crash")  # it waited behind the blocked loop
        crash = executor.submit(ToolCall("async_dies", {})).result()
        assert crash.kind == "crash" and "exit code 4" in crash.text
        assert executor.submit(ToolCall("nap", {"seconds": 0.01})).result().text == "rested"
        assert executor.started == 3  # replaced after the blocked loop and after the crash
    finally:
        executor.close()


def test_tools_that_cannot_travel_are_refused_up_front() -> None:
    import threading

    lock = threading.Lock()

    def locked(x: int) -> int:
        """Hold a lock.

        Args:
            x: a number.
        """
        with lock:
            return x

    with pytest.raises(TypeError, match=r"the tools \['locked'\] cannot be sent to their worker processes"):
        ToolExecutor({"locked": locked})
