"""``reward.kind: math_verify``: answer checking with Hugging Face's ``math-verify``.

It parses LaTeX and plain expressions (``\\boxed{..}``, fractions, sets, intervals,
units) and compares them symbolically with sympy. Its own timeouts use
``signal.alarm``, which works only in a process's main thread, and sympy can take
unbounded time on odd input, so it runs in the reward sandbox
(``gpu_runtime.data.rewards.sandbox``): the main thread of a child process that
the scorer kills when a call outlives ``reward.timeout_s``.
"""

from __future__ import annotations

import importlib.util

MISSING = (
    "reward.kind: math_verify needs the math-verify package on the control worker "
    "(pip install 'math-verify==0.9.0', or install milestone with its dependencies)"
)


def available() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def gold_text(label: str) -> str:
    """The part of a label to verify against: what follows its last ``####`` (GSM8K), else all of it."""
    _, sep, tail = label.rpartition("####")
    return (tail if sep else label).strip()


def math_verify_reward(prompt: str, response: str, row: dict) -> float:
    """1.0 when math-verify finds the response's answer equal to the row's label, else 0.0.
    ValueError naming the row when the label parses to nothing."""
    from math_verify import parse, verify  # lazy: an optional heavy import (sympy, antlr)

    label = row.get("answer")
    text = gold_text(label) if isinstance(label, str) else ""
    gold = parse(text) if text else []
    if text and not gold:  # a bare LaTeX expression needs its math delimiters
        gold = parse(f"${text}$")
    if not gold:
        raise ValueError(f"row {row.get('id')!r}: field 'answer' has no answer math-verify can parse: {label!r}")
    return 1.0 if verify(gold, parse(response)) else 0.0
