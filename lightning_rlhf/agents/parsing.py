"""Tool calls in a model's text: the formats chat templates write them in, and a registry for more.

A parser turns one assistant turn's text into its prose and its calls. A malformed call (not JSON, no ``name``,
arguments that are not an object) is kept as a :class:`ToolCall` with its ``error`` set, so that the environment
answers it with an observation that says what was wrong. The default format is Hermes'
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: Qwen2/2.5/3, NousResearch); ``"template"`` reads a
tokenizer's ``response_template`` with transformers' ``parse_response``, and ``"auto"`` picks it when the tokenizer
has one. Formats and the registry: docs/agents.md.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = [
    "ParsedTurn",
    "ToolCall",
    "get_tool_parser",
    "parse_hermes",
    "parse_json_calls",
    "parse_with_template",
    "register_tool_parser",
    "resolve_tool_parser",
]


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: the tool's ``name``, its ``arguments`` and the ``raw`` text it came from.
    ``error`` is set (and ``name``/``arguments`` may be empty) when the call could not be read."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None


@dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn's ``content`` (its text without the calls) and its ``calls`` in order."""

    content: str
    calls: tuple[ToolCall, ...] = ()


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _read_call(raw: str) -> ToolCall:
    """One call's JSON object, or a call with the ``error`` that says what is wrong with it."""
    try:
        obj = json.loads(raw.strip())
    except json.JSONDecodeError as err:
        return ToolCall("", raw=raw, error=f"the tool call is not valid JSON ({err.msg} at character {err.pos})")
    return _checked_call(obj, raw)


def _checked_call(obj: Any, raw: str) -> ToolCall:
    """A call from its parsed object (``{"name": ..., "arguments": {...}}``), or one with the ``error`` that says
    what is wrong with it."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", raw=raw, error='the tool call needs a "name" (a string) and "arguments" (an object)')
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API does
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], raw=raw, error=f'the "arguments" of {obj["name"]!r} must be a JSON object')
    return ToolCall(obj["name"], arguments, raw=raw)


def parse_hermes(text: str) -> ParsedTurn:
    """Hermes-style calls: each ``<tool_call>`` JSON ``</tool_call>`` block (an unclosed last block, cut by the
    token budget, counts as a malformed call). Runs on: the process that runs the rollout (a worker)."""
    calls = tuple(_read_call(m[1]) for m in _HERMES.finditer(text))
    content = _HERMES.sub("", text).strip()
    unclosed = text.rfind("<tool_call>") > text.rfind("</tool_call>")
    if unclosed and calls and calls[-1].error is None:  # the regex took the rest of the text as its body
        calls = (*calls[:-1], replace(calls[-1], error="the tool call has no </tool_call>"))
    return ParsedTurn(content, calls)


def parse_json_calls(text: str) -> ParsedTurn:
    """Llama 3's format (vLLM's ``llama3_json``): a turn that is a JSON call ``{"name": ..., "parameters": {...}}``
    (after an optional ``<|python_tag|>``), several separated by ``;``; any other turn is prose with no call.
    Runs on: the process that runs the rollout (a worker)."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return ParsedTurn(text.strip())
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError as err:
            calls.append(ToolCall("", raw=body[at:], error=f"the tool call is not valid JSON ({err.msg})"))
            break
        calls.append(_checked_call(obj, body[at:end]))
        rest = body[end:].lstrip().removeprefix(";").lstrip()
        at = len(body) - len(rest)
    return ParsedTurn("", tuple(calls))


def parse_with_template(
    tokenizer: Any, turn: list[int], prefix: list[int], tools: list[dict[str, Any]] | None = None
) -> ParsedTurn:
    """An assistant turn's ids read by the tokenizer's ``response_template`` (transformers' ``parse_response``):
    ``prefix``, the ids before the turn (the generation prompt at least), and ``tools``, the schemas (the arguments
    are typed by them). A region the template cannot read (a call whose JSON is broken) gives one malformed call.
    Runs on: the process that runs the rollout (a worker)."""
    try:
        message = tokenizer.parse_response(turn, prefix=prefix, tools=tools or None)
    except ValueError as err:  # transformers' parser names the region it could not read
        reason = str(err).splitlines()[0].rstrip(".")
        malformed = ToolCall("", raw=tokenizer.decode(turn), error=f"the tool call cannot be read ({reason})")
        return ParsedTurn("", (malformed,))
    functions = [e.get("function", e) if isinstance(e, dict) else e for e in message.get("tool_calls") or []]
    calls = tuple(_checked_call(function, json.dumps(function, default=str)) for function in functions)
    return ParsedTurn(str(message.get("content") or ""), calls)


def resolve_tool_parser(name: str, tokenizer: Any) -> str:
    """The format ``RolloutConfig(tool_parser=name)`` means for ``tokenizer``: ``"auto"`` is ``"template"`` when the
    tokenizer carries a ``response_template``, else ``"hermes"``. Runs on: any process (the module checks it when it
    is built). Raises ValueError for ``"template"`` without one, or a name that is not registered."""
    has_template = getattr(tokenizer, "response_template", None) is not None
    if name == "auto":
        return "template" if has_template else "hermes"
    if name == "template":
        if not has_template:
            raise ValueError(
                "RolloutConfig(tool_parser='template') reads calls with the tokenizer's response_template, and this "
                "tokenizer has none. HINT: tool_parser='auto' (Hermes without one), a registered format, or set "
                "tokenizer.response_template (TRL's add_response_schema sets it for the templates it knows)."
            )
        return name
    get_tool_parser(name)
    return name


ToolParser = Callable[[str], ParsedTurn]
_PARSERS: dict[str, ToolParser] = {"hermes": parse_hermes, "llama3_json": parse_json_calls}


def register_tool_parser(name: str, parser: ToolParser) -> None:
    """Make ``parser`` (text -> :class:`ParsedTurn`) available as ``RolloutConfig(tool_parser=name)``; a name
    registered again is replaced. Runs on: every process that builds the rollout (register at import time of the
    user's module, as a recipe's reward functions are). Raises ValueError for a reserved name or a non-callable."""
    if name in ("auto", "template"):
        raise ValueError(f"register_tool_parser({name!r}, ...): {name!r} is reserved. HINT: choose another name.")
    if not name or not callable(parser):
        raise ValueError(f"register_tool_parser({name!r}, {parser!r}): needs a name and a callable text -> ParsedTurn")
    _PARSERS[name] = parser


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``. Runs on: any process. Raises ValueError naming the known formats."""
    if name not in _PARSERS:
        raise ValueError(
            f"RolloutConfig(tool_parser={name!r}) is not a registered format (known: 'auto', 'template', "
            f"{', '.join(map(repr, sorted(_PARSERS)))}). HINT: "
            "register yours with lightning_rlhf.agents.register_tool_parser(name, parser)."
        )
    return _PARSERS[name]
