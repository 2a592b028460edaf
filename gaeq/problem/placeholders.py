"""`{name}` and small integer expressions of names (`{grad_accum_steps * world_size}`) inside a
script's arguments, evaluated without `eval`: names, integers, + - * // and parentheses only.

Scripts' arguments hold braces of their own — the transformers Trainer's JSON flags
(`--accelerator_config '{"split_batches": true}'`, `--deepspeed '{...}'`), a regex's `\\d{3}` — so
not every `{…}` is a placeholder. A field (innermost braces, none nested inside) is one only when its
text is such an expression with at least one name; its names must be known (NAMES), so that a typo
(`{micro_batch}`) is bad input instead of text the script receives as is. Every other field passes
through byte for byte: what does not parse (JSON, `{}`), what names nothing (`{3}`, `{2,5}`), what
names nothing of gaeq's (`{args.lr}`) — never evaluated. A field of another shape that names a known
name (`{micro_batch_size ** 2}`) is bad input: it can only be a placeholder gaeq cannot fill.

A literal placeholder-shaped text is written with doubled braces: `{{micro_batch_size}}` gives
`{micro_batch_size}`. Other doubled braces (the end of `{"a": {"b": 1}}`) are left as written.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Mapping

INTEGERS = ("micro_batch_size", "grad_accum_steps", "world_size", "train_batch_size", "steps", "seed")
PATHS = ("deepspeed_config", "cell_dir")
NAMES = INTEGERS + PATHS
"""What an argument may name; the integers can take part in expressions, the paths only stand alone."""

_FIELD = re.compile(r"\{\{([^{}]*)\}\}|\{([^{}]*)\}")
"""A field, tried doubled first (`{{name}}`, the escape) at each position."""
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


class PlaceholderError(ValueError):
    """A placeholder gaeq cannot fill: an unknown name, or an expression beyond integer arithmetic."""


def fill(argument: str, values: Mapping[str, object]) -> str:
    """`argument` with every placeholder replaced by its value; every other brace kept as written."""

    def replace(match: re.Match[str]) -> str:
        doubled, single = match.groups()
        if single is not None:
            return _field(single, values)
        if _shaped(_parse(doubled)):
            return f"{{{doubled}}}"  # the escape: a literal {name}
        return f"{{{_field(doubled, values)}}}"

    return _FIELD.sub(replace, argument)


def check(argument: str) -> None:
    """Raise PlaceholderError for a placeholder no cell could fill (every name known, every value 1)."""
    fill(argument, dict.fromkeys(INTEGERS, 1) | dict.fromkeys(PATHS, "path"))


def _field(content: str, values: Mapping[str, object]) -> str:
    """What `{content}` becomes: its value if it is a placeholder, else itself."""
    tree = _parse(content)
    names = [node.id for node in ast.walk(tree) if isinstance(node, ast.Name)] if tree else []
    if _shaped(tree):
        unknown = next((name for name in names if name not in NAMES), None)
        if unknown is not None:
            raise PlaceholderError(
                f"{{{content}}}: unknown name {unknown!r}; known: {', '.join(NAMES)} "
                f"(for the literal text {{{content}}}, write {{{{{content}}}}})"
            )
        return str(_value(tree, content, values))
    if any(name in NAMES for name in names):
        raise PlaceholderError(f"{{{content}}}: only names, integers, + - * // and parentheses")
    return f"{{{content}}}"


def _parse(content: str) -> ast.expr | None:
    """The expression a field holds, or None when it holds none (JSON, `{}`)."""
    try:
        return ast.parse(content.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None


def _shaped(tree: ast.expr | None) -> bool:
    """Is it a placeholder: names, integers, + - * //, unary minus and parentheses, with a name?"""

    def allowed(node: ast.expr) -> bool:
        if isinstance(node, ast.BinOp):
            return type(node.op) in _OPS and allowed(node.left) and allowed(node.right)
        if isinstance(node, ast.UnaryOp):
            return isinstance(node.op, ast.USub) and allowed(node.operand)
        return isinstance(node, ast.Name) or (isinstance(node, ast.Constant) and type(node.value) is int)

    return tree is not None and allowed(tree) and any(isinstance(node, ast.Name) for node in ast.walk(tree))


def _value(node: ast.expr, content: str, values: Mapping[str, object]) -> object:
    """The value of a placeholder-shaped expression whose names are all known."""
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp):
        operands = [_value(node.operand, content, values)]
    else:
        operands = [_value(node.left, content, values), _value(node.right, content, values)]
    if not all(isinstance(operand, int) for operand in operands):
        raise PlaceholderError(f"{{{content}}}: arithmetic on a path")
    if isinstance(node, ast.UnaryOp):
        return -operands[0]
    if isinstance(node.op, ast.FloorDiv) and operands[1] == 0:
        raise PlaceholderError(f"{{{content}}}: division by zero")
    return _OPS[type(node.op)](*operands)
