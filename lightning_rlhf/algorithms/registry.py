"""A tiny name -> callable registry with helpful error messages."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable[..., object])

__all__ = ["Registry"]


class Registry(Generic[F]):
    """Maps string names to callables of one ``kind`` (e.g. ``"advantage estimator"``, as errors name it).

    Runs on: controller or worker (pure function).

    Example:
        >>> REG: Registry[Callable[[int], int]] = Registry("doubler")
        >>> @REG.register("twice")
        ... def twice(x: int) -> int:
        ...     return 2 * x
        >>> REG.get("twice")(3)
        6
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Returns a decorator that registers a callable under ``name`` (and returns it unchanged).

        Raises:
            ValueError: If ``name`` is already registered.
        """

        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"Duplicate {self.kind} '{name}': already registered.")
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The callable registered as ``name``.

        Raises:
            ValueError: If ``name`` is unknown; the message lists valid names and a close match if any.
        """
        if name in self._entries:
            return self._entries[name]
        valid = ", ".join(self.names())
        msg = f"Unknown {self.kind} '{name}'. Valid: {valid}."
        close = difflib.get_close_matches(name, self.names(), n=1)
        if close:
            msg += f" Did you mean '{close[0]}'?"
        raise ValueError(msg)

    def names(self) -> list[str]:
        """Returns the registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
