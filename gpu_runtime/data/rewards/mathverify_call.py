"""The math-verify check, run in the reward process (``sandbox``): importing this module
imports math-verify and sympy, which the sandbox does in its load step, outside the
per-call timeout."""

from __future__ import annotations

from math_verify import parse, verify

from gpu_runtime.data.rewards.mathverify import gold_text


def math_verify_reward(prompt: str, response: str, row: dict) -> float:
    """1.0 when math-verify finds the response's answer equal to the row's label, else 0.0.
    ValueError naming the row when the label parses to nothing."""
    label = row.get("answer")
    text = gold_text(label) if isinstance(label, str) else ""
    gold = parse(text) if text else []
    if text and not gold:  # a bare LaTeX expression needs its math delimiters
        gold = parse(f"${text}$")
    if not gold:
        raise ValueError(f"row {row.get('id')!r}: field 'answer' has no answer math-verify can parse: {label!r}")
    return 1.0 if verify(gold, parse(response)) else 0.0
