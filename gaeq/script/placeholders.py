"""`{name}` and small integer expressions of names (`{grad_accum_steps * world_size}`) inside a
script's arguments, evaluated without `eval`: names, integers, + - * // and parentheses only."""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Mapping

INTEGERS = ("micro_batch_size", "grad_accum_steps", "world_size", "train_batch_size", "steps", "seed")
PATHS = ("deepspeed_config", "cell_dir")
NAMES = INTEGERS + PATHS
"""What an argument may name; the integers can take part in expressions, the paths only stand alone."""

_FIELD = re.compile(r"\{([^{}]*)\}")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


class PlaceholderError(ValueError):
    """A placeholder gaeq cannot fill: an unknown name, or an expression beyond integer arithmetic."""


def fill(argument: str, values: Mapping[str, object]) -> str:
    """`argument` with every `{…}` replaced by its value (`{{` and `}}` are not special: scripts'
    arguments rarely hold braces, and a lone brace is kept as written)."""
    return _FIELD.sub(lambda m: str(evaluate(m.group(1), values)), argument)


def check(argument: str) -> None:
    """Raise PlaceholderError for a placeholder no cell could fill (every name known, every value 1)."""
    fill(argument, dict.fromkeys(INTEGERS, 1) | dict.fromkeys(PATHS, "path"))


def evaluate(expression: str, values: Mapping[str, object]) -> object:
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise PlaceholderError(f"{{{expression}}}: not a name or an integer expression of names") from None
    return _value(tree.body, expression, values)


def _value(node: ast.AST, expression: str, values: Mapping[str, object]) -> object:
    if isinstance(node, ast.Name):
        if node.id not in NAMES:
            raise PlaceholderError(f"{{{expression}}}: unknown name {node.id!r}; known: {', '.join(NAMES)}")
        return values[node.id]
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _value(node.left, expression, values), _value(node.right, expression, values)
        if not (isinstance(left, int) and isinstance(right, int)):
            raise PlaceholderError(f"{{{expression}}}: arithmetic on a path")
        if isinstance(node.op, ast.FloorDiv) and right == 0:
            raise PlaceholderError(f"{{{expression}}}: division by zero")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _value(node.operand, expression, values)
        if isinstance(value, int):
            return -value
    raise PlaceholderError(f"{{{expression}}}: only names, integers, + - * // and parentheses")
