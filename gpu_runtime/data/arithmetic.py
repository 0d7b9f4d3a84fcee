"""The built-in offline dataset: ``A<op>B=`` arithmetic in normalized rows.

Each row is ``{"id": "arith-<seed>-<i>", "prompt": "23+45=", "messages": None,
"answer": "23+45=68\\n#### 68", "metadata": {}}``: the policy sees the prompt
and, for SFT, learns the bare final answer (``"68"``) followed by EOS. Pure Python.
"""

from __future__ import annotations

import random

from gpu_runtime.store.artifacts import derive_seed

_OPS = "+-*"


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"ops: unsupported operator {op!r} (use any of {_OPS!r})")


def generate_arithmetic(n: int, seed: int, max_operand: int = 99, ops: str = "+") -> list[dict]:
    """``n`` rows ``a<op>b=`` with 0 <= a, b <= max_operand, deterministic in ``seed``."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if max_operand < 0:
        raise ValueError(f"max_operand must be >= 0, got {max_operand}")
    if not ops or any(o not in _OPS for o in ops):
        raise ValueError(f"ops must be a non-empty string of {_OPS!r}, got {ops!r}")
    rng = random.Random(derive_seed("arithmetic", seed))
    rows: list[dict] = []
    for i in range(n):
        a = rng.randint(0, max_operand)
        b = rng.randint(0, max_operand)
        op = ops[rng.randrange(len(ops))]
        c = _apply(a, op, b)
        rows.append({
            "id": f"arith-{seed}-{i:06d}",
            "prompt": f"{a}{op}{b}=",
            "messages": None,
            "answer": f"{a}{op}{b}={c}\n#### {c}",
            "metadata": {},
        })
    return rows
