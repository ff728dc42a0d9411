"""A safe arithmetic evaluator for the ``calc`` tool: no ``eval``, no names, no calls.

Accepts integers and decimals, ``+ - * / // % **``, unary signs and parentheses. Limits keep a
hostile expression from burning CPU or memory: its length, the depth of the syntax tree, the
size of exponents and the magnitude of every intermediate result.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_LENGTH = 200
MAX_DEPTH = 32
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e15


class CalcError(ValueError):
    """The expression is not allowed or cannot be evaluated; the message says why."""


_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


def evaluate(expression: str) -> int | float:
    if not isinstance(expression, str):
        raise CalcError("the expression must be a string")
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    if not text:
        raise CalcError("the expression is empty")
    if len(text) > MAX_LENGTH:
        raise CalcError(f"the expression is longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalcError(f"cannot parse {expression!r} as arithmetic") from None
    return _eval(tree.body, 0)


def _check(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalcError("the result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError(f"a value exceeds {MAX_MAGNITUDE:g} in magnitude")
    return value


def _eval(node: ast.expr, depth: int) -> int | float:
    if depth > MAX_DEPTH:
        raise CalcError("the expression is nested too deeply")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalcError("only numbers are allowed")
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand, depth + 1)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _eval(node.left, depth + 1)
        right = _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalcError(f"exponents are limited to {MAX_EXPONENT}")
        try:
            result = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalcError("division by zero") from None
        except OverflowError:
            raise CalcError("the result is too large") from None
        if isinstance(result, complex):
            raise CalcError("the result is not a real number")
        return _check(result)
    raise CalcError(f"{type(node).__name__} is not allowed; use numbers and + - * / // % ** ( )")


def format_number(value: int | float) -> str:
    """Integers as integers; other values with up to 6 decimals, trailing zeros removed."""
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")
