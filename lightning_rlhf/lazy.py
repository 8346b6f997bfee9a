"""Public names that load on first use (PEP 562), for the package's ``__init__`` files.

Reward and tool workers import the plain function they run (``lightning_rlhf.demo.calculator``), and importing a
module imports every package above it first: eager re-exports would cost each worker Lightning, torch and
transformers (about 7 s of CPU per process on these machines). Standard library only.

A lazy ``__init__`` writes its re-exports under ``if TYPE_CHECKING:`` (type checkers, linters and the API docs read
them as imports), keeps its literal ``__all__``, and ends with ``__getattr__, __dir__ = lazy_exports(__name__,
__file__)``: those imports are the map from name to module."""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_exports", "type_checking_imports"]


def type_checking_imports(path: str) -> dict[str, str]:
    """``{name: module}`` of the ``from module import name`` statements under ``if TYPE_CHECKING:`` in the file
    ``path``. Runs on: any process (at import of a lazy package)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
                    found.update({alias.asname or alias.name: stmt.module for alias in stmt.names})
    return found


def lazy_exports(package: str, init_file: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``'s ``__init__`` (``init_file``): a public name imported under ``if
    TYPE_CHECKING:`` there loads from its module on first access and is cached in the package's namespace. Runs on: any
    process (at import of a package)."""
    exports = type_checking_imports(init_file)

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
