"""Rule rewards computed in the scoring process: the integer answer rule
(``math_answer``), GSM8K answer extraction (``gsm8k``) and a format regex (``format``).

Each returns ``(reward, correct)``; ``correct`` is ``None`` when the rule does not
check the answer (``format``).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Literal

from gpu_runtime.data.rows import final_answer

_INT_RE = re.compile(r"-?\d+")
_HASH_RE = re.compile(r"####\s*(-?\d+)")
# a number as GSM8K writes them: optional minus and dollar sign, thousands commas, decimals
_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_STRICT_RE = re.compile(r"####\s*(" + _NUMBER + ")")


def extract_answer(text: str) -> str | None:
    """The answer in a response: the integer after the last ``####`` if any,
    else the last integer in the text; ``None`` when there is none. Normalised
    (``"007"`` -> ``"7"``)."""
    hashes = _HASH_RE.findall(text)
    if hashes:
        return str(int(hashes[-1]))
    ints = _INT_RE.findall(text)
    if not ints:
        return None
    return str(int(ints[-1]))


def math_answer_reward(response_text: str, row: dict) -> tuple[float, bool]:
    """(1.0, True) when the extracted answer equals the row's final answer, else (0.0, False).
    ValueError naming the row when its label holds no integer answer."""
    got = extract_answer(response_text)
    correct = got is not None and got == final_answer(row)
    return (1.0 if correct else 0.0), correct


def normalize_number(token: str) -> str | None:
    """A GSM8K number as a canonical string: commas, ``$`` and spaces dropped, a trailing
    ``.`` dropped, ``72.0`` -> ``72``, ``0.50`` -> ``0.5``; ``None`` when it is no number."""
    s = re.sub(r"[,$\s]", "", token).rstrip(".")
    try:
        d = Decimal(s)
    except InvalidOperation:
        return None
    if not d.is_finite():
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def gsm8k_extract(text: str, mode: Literal["strict", "flexible"]) -> str | None:
    """The response's answer, normalised: ``strict``, the number right after the first
    ``####`` (the GSM8K format: it also checks the model wrote it); ``flexible``, the last
    number anywhere in the text. ``None`` when there is none."""
    if mode == "strict":
        m = _STRICT_RE.search(text)
        return normalize_number(m.group(1)) if m else None
    numbers = _NUMBER_RE.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def gsm8k_label(row: dict) -> str:
    """The row's answer: the first number after the label's last ``####``, else the first
    number of the label; ValueError naming the row when there is none."""
    label = row.get("answer")
    got = None
    if isinstance(label, str):
        _, sep, tail = label.rpartition("####")
        m = _NUMBER_RE.search(tail if sep else label)
        got = normalize_number(m.group(0)) if m else None
    if got is None:
        raise ValueError(
            f"row {row.get('id')!r}: field 'answer' has no number for reward.kind gsm8k "
            f"(expected '#### <number>' or a number), got {label!r}"
        )
    return got


def gsm8k_reward(
    response_text: str, row: dict, mode: Literal["strict", "flexible"], format_score: float
) -> tuple[float, bool, str | None]:
    """(1.0, True) for the right answer; (format_score, False) for an answer found but wrong;
    (0.0, False) when none is found. The third item is the extracted answer."""
    got = gsm8k_extract(response_text, mode)
    if got is None:
        return 0.0, False, None
    if got == gsm8k_label(row):
        return 1.0, True, got
    return format_score, False, got


def format_reward(response_text: str, pattern: str, format_score: float) -> float:
    """``format_score`` when the whole response matches ``pattern`` (``.`` also matches a
    newline), else 0.0."""
    return format_score if re.fullmatch(pattern, response_text, re.DOTALL) else 0.0
