"""The ``calculator`` tool: integer/float arithmetic parsed with ``ast``, never ``eval``.

Only numbers, ``+ - * / // % **``, unary minus/plus and parentheses are accepted.
Exponents and results are bounded, so an expression such as ``9**9**9`` is an error,
not a hung node agent.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_DIGITS = 60  # results beyond 10**60 are refused (they could only come from abuse)

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value is out of bounds."""


def _bounded(x: int | float) -> int | float:
    if isinstance(x, float) and not math.isfinite(x):
        raise CalculatorError("result is not finite")
    if abs(x) >= 10 ** MAX_DIGITS:
        raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
    return x


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result is too large") from None
    raise CalculatorError(f"not allowed in an expression: {type(node).__name__}")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic ``expression`` (``CalculatorError`` for anything else)."""
    text = expression.strip().replace("×", "*").replace("^", "**")
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {text!r}") from None
    return _eval(tree.body)


def format_value(x: int | float) -> str:
    """``56088`` for integers (also integral floats such as ``8/2``), else up to 12 significant digits."""
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return str(x) if isinstance(x, int) else f"{x:.12g}"
