"""Tools for the agent tests, in a module that imports only the standard library: a tool worker imports the module
that defines its tools, so tools kept apart from torch-importing modules start in a fraction of a second (the
same holds for users' tools; docs/agents.md)."""

from __future__ import annotations

import asyncio
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


# ``async def`` tools: they share one worker's event loop, every call at once.
_arrived = 0
_all_in: asyncio.Event | None = None


async def gather_up(count: int) -> int:
    """Wait until `count` calls of this tool are running at once, then answer how many have arrived.

    Args:
        count: the calls to wait for.
    """
    global _arrived, _all_in
    if _all_in is None:
        _all_in = asyncio.Event()
    _arrived += 1
    if _arrived >= count:
        _all_in.set()
    await _all_in.wait()  # one call at a time would wait here until its timeout
    return _arrived


async def nap(seconds: float) -> str:
    """Sleep without blocking the event loop.

    Args:
        seconds: how long.
    """
    await asyncio.sleep(seconds)
    return "rested"


async def blocks_the_loop(seconds: float) -> str:
    """Sleep the wrong way in an async tool: the event loop stops with it.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "late"


async def async_raises(text: str) -> str:
    """Raise.

    Args:
        text: the message.
    """
    raise RuntimeError(text)


async def async_unreadable() -> object:
    """Return an object that has no text form."""
    return object()


async def async_dies() -> str:
    """End the process."""
    os._exit(4)


def flood(size: int) -> str:
    """Return a result of `size` characters (a tool that dumps a whole file or page).

    Args:
        size: how many characters.
    """
    return "x" * size
