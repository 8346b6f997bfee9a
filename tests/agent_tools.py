"""Tools for the agent tests, in a module that imports only the standard library: a tool worker imports the module
that defines its tools, so tools kept apart from torch-importing modules start in a fraction of a second (the
same holds for users' tools; docs/agents.md)."""

from __future__ import annotations

import os
import time


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: digits and + - * / ( ), e.g. "37 * (41 + 2)".
    """
    if set(expression) - set("0123456789+-*/() ."):
        raise ValueError(f"not arithmetic: {expression!r}")
    return str(eval(expression, {"__builtins__": {}}))  # only digits and operators get here


def power(base: int, exponent: int = 2) -> int:
    """Raise a number to a power.

    Args:
        base: the number.
        exponent: the power.
    """
    return base**exponent


def sleepy(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "awake"


def unreadable() -> object:
    """Return an object that has no text form."""
    return object()


def dies() -> str:
    """End the process."""
    os._exit(3)
