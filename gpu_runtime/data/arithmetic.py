"""The built-in offline dataset: ``A<op>B=`` arithmetic in normalized rows.

Each row is ``{"id": "arith-<seed>-<i>", "prompt": "23+45=", "messages": None,
"answer": "23+45=68\\n#### 68", "metadata": {}}``: the policy sees the prompt
and, for SFT, learns the bare final answer (``"68"``) followed by EOS. Pure Python.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterable

from gpu_runtime.data.rows import final_answer
from gpu_runtime.store.artifacts import derive_seed

_OPS = "+-*"
_PROMPT = re.compile(r"(\d+)([+\-*])(\d+)=")


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"ops: unsupported operator {op!r} (use any of {_OPS!r})")


def _check(n: int, max_operand: int, ops: str, min_operand: int = 0) -> None:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"min_operand must be in 0..max_operand ({max_operand}), got {min_operand}")
    if not ops or any(o not in _OPS for o in ops):
        raise ValueError(f"ops must be a non-empty string of {_OPS!r}, got {ops!r}")


def _draw(rng: random.Random, row_id: str, max_operand: int, ops: str, min_operand: int = 0) -> dict:
    a = rng.randint(min_operand, max_operand)
    b = rng.randint(min_operand, max_operand)
    op = ops[rng.randrange(len(ops))]
    c = _apply(a, op, b)
    return {
        "id": row_id, "prompt": f"{a}{op}{b}=", "messages": None, "answer": f"{a}{op}{b}={c}\n#### {c}", "metadata": {},
    }


def as_chat(row: dict) -> dict:
    """An arithmetic row as a chat, for an instruction-tuned model: the user asks ``What is
    a<op>b?`` (the model's chat template renders it); the label stays ``"#### c"``. The
    expression is kept in ``metadata.expression`` (the held-out split excludes by it) and the
    SFT target is the bare answer."""
    expr, value = row["prompt"], final_answer(row)
    return {**row, "prompt": None, "messages": [{"role": "user", "content": f"What is {expr[:-1]}?"}],
            "answer": f"#### {value}", "metadata": {"expression": expr, "sft_target": value}}


def expression(row: dict) -> str | None:
    """The ``a<op>b=`` a plain or chat arithmetic row asks (other rows: their prompt)."""
    return row.get("prompt") or (row.get("metadata") or {}).get("expression")


def generate_arithmetic(
    n: int, seed: int, max_operand: int = 99, ops: str = "+", *, min_operand: int = 0, chat: bool = False
) -> list[dict]:
    """``n`` rows ``a<op>b=`` with min_operand <= a, b <= max_operand, deterministic in
    ``seed``. ``min_operand=10, max_operand=99`` is 2-digit arithmetic: every prompt
    has the same layout (``DD+DD=``), which a small model learns far faster than the
    mixed 1- and 2-digit operands of ``0..99`` (bench/plain_grpo.py, 300 SFT steps).
    ``chat``: each row ``as_chat`` (the same draws)."""
    _check(n, max_operand, ops, min_operand)
    rng = random.Random(derive_seed("arithmetic", seed))
    rows = [_draw(rng, f"arith-{seed}-{i:06d}", max_operand, ops, min_operand) for i in range(n)]
    return [as_chat(r) for r in rows] if chat else rows


def generate_heldout_arithmetic(
    n: int, seed: int, max_operand: int = 99, ops: str = "+", *, exclude: Iterable[str] = (), min_operand: int = 0,
    chat: bool = False,
) -> list[dict]:
    """Held-out rows: the same generator under a derived seed, keeping only prompts not
    in ``exclude`` (the train rows' ``expression``) and not drawn before. Fewer than ``n`` rows when
    fewer unseen prompts exist ((max_operand-min_operand+1)^2 per operator); none when there are none."""
    _check(n, max_operand, ops, min_operand)
    seen = set(exclude)
    in_space = sum(
        1 for p in seen
        if (m := _PROMPT.fullmatch(p)) and m.group(2) in ops
        and min_operand <= min(int(m.group(1)), int(m.group(3))) and max(int(m.group(1)), int(m.group(3))) <= max_operand
    )
    want = min(n, (max_operand - min_operand + 1) ** 2 * len(set(ops)) - in_space)
    rng = random.Random(derive_seed("arithmetic-eval", seed))
    rows: list[dict] = []
    while len(rows) < want:
        row = _draw(rng, f"arith-eval-{seed}-{len(rows):06d}", max_operand, ops, min_operand)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    return [as_chat(r) for r in rows] if chat else rows
