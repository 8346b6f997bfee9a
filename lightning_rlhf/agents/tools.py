"""Tools: plain Python functions, their JSON schemas (``transformers.utils.get_json_schema``, from the type hints
and the Google-style docstring), and the checks a call goes through before it runs in a tool worker, so that the
model gets an observation saying what was wrong (unknown tool, unknown or missing arguments, a wrong JSON type).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_rlhf.agents.parsing import ToolCall

__all__ = ["ToolSet", "tool_schema"]

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``fn`` as chat templates take it (``{"type": "function", "function": {...}}``). Runs on:
    any process (the controller checks the tools before training starts). Raises ValueError naming the function
    and what its signature or docstring lacks."""
    from transformers.utils import get_json_schema

    name = getattr(fn, "__name__", repr(fn))
    try:
        return get_json_schema(fn)
    except Exception as err:  # DocstringParsingException / TypeHintParsingException / ValueError
        raise ValueError(
            f"tool {name!r}: its JSON schema cannot be made ({err}). HINT: a tool is a plain function with a type "
            "hint on every parameter and a Google-style docstring: a description, then 'Args:' with one "
            "'name: description' line per parameter."
        ) from err


def _type_ok(value: Any, spec: Mapping[str, Any]) -> bool:
    """Whether ``value`` (parsed JSON) has one of the JSON types ``spec`` allows (a bool is no number)."""
    kinds = spec.get("type")
    if kinds is None:
        return True
    for kind in [kinds] if isinstance(kinds, str) else kinds:
        if kind not in _JSON_TYPES:
            return True  # a type this check does not know: the tool itself decides
        if isinstance(value, bool) and kind in ("integer", "number"):
            continue
        if isinstance(value, _JSON_TYPES[kind]):
            return True
    return False


class ToolSet:
    """The tools of an environment, by name, with their schemas. Runs on: any process."""

    def __init__(self, tools: Sequence[Callable[..., Any]]) -> None:
        self.functions: dict[str, Callable[..., Any]] = {}
        self.schemas: list[dict[str, Any]] = []
        for fn in tools:
            if not callable(fn):
                raise ValueError(f"tools=[..., {fn!r}, ...]: a tool must be a function. HINT: pass the function.")
            schema = tool_schema(fn)
            name = schema["function"]["name"]
            if name in self.functions:
                raise ValueError(f"tools: two tools are named {name!r}. HINT: give each tool its own name.")
            self.functions[name] = fn
            self.schemas.append(schema)

    def __len__(self) -> int:
        return len(self.functions)

    def rebound(self, tools: Sequence[Callable[..., Any]]) -> ToolSet:
        """The same tools and schemas calling ``tools`` instead (another instance's bound methods, in the same
        order): an environment whose tools keep state gets its own. Runs on: the rollout's process."""
        other = copy.copy(self)
        other.functions = dict(zip(self.functions, tools, strict=True))
        return other

    def check(self, call: ToolCall) -> str | None:
        """What is wrong with ``call`` before it runs (None: it may run): a parse error, an unknown tool, an
        unknown or missing argument, an argument of the wrong JSON type. Runs on: the rollout's process."""
        if call.error is not None:
            return call.error
        if call.name not in self.functions:
            return f"there is no tool named {call.name!r} (the tools: {', '.join(self.functions) or 'none'})"
        params = next(s for s in self.schemas if s["function"]["name"] == call.name)["function"]["parameters"]
        properties: Mapping[str, Any] = params.get("properties", {})
        unknown = sorted(set(call.arguments) - set(properties))
        if unknown:
            return f"{call.name} takes no argument {', '.join(map(repr, unknown))} (it takes {sorted(properties)})"
        missing = [p for p in params.get("required", []) if p not in call.arguments]
        if missing:
            return f"{call.name} needs the argument(s) {', '.join(map(repr, missing))}"
        for key, value in call.arguments.items():
            if not _type_ok(value, properties[key]):
                return f"{call.name}'s argument {key!r} must be of type {properties[key].get('type')}, got {value!r}"
        return None
