"""The tool task's ``calculator``, in a module of its own that imports only the standard library: TRL's side of
the tool benchmark (``benchmarks/vs_trl/run_trl_tools.py``, in a virtualenv without lightning_rlhf) loads this file
by its path and gives TRL the same tool.

Runs on: wherever the tool is called (a tool worker process, or TRL's trainer)."""

from __future__ import annotations

import ast
import operator

__all__ = ["calculator"]

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression with +, - and *.

    Args:
        expression: The expression, e.g. "482+397" or "12*(3-1)".
    """

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return int(_OPS[type(node.op)](value(node.left), value(node.right)))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an integer expression with + - *: {expression!r}")

    if len(expression) > 100:
        raise ValueError("expression longer than 100 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an integer expression with + - *: {expression!r}") from None
    return str(value(tree.body))
