"""An offline arithmetic dataset in GSM8K-like JSONL, and the deterministic
prompt order of a run.

Each row is ``{"id": str, "question": str, "answer": str}`` where ``answer``
ends with ``#### <int>`` (GSM8K's convention), e.g.::

    {"id": "add-000001", "question": "What is 23+45?", "answer": "23+45=68\\n#### 68"}

The policy sees a short prompt (``"23+45="``) and, for SFT, learns the bare
final answer (``"68"``) followed by EOS. Rows whose question is not of the
``What is A<op>B?`` form (e.g. real GSM8K rows) get ``question + "\\nAnswer: "``
as prompt and their full answer text as SFT target.

Pure Python.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import json
import random
import re
from pathlib import Path

from gpu_runtime.store.artifacts import derive_seed

if TYPE_CHECKING:  # the tokenizer pulls in transformers: not needed to read data
    from gpu_runtime.models.tokenizer import Tokenizer

REQUIRED_FIELDS = ("id", "question", "answer")
_OPS = "+-*"
_QUESTION_RE = re.compile(r"^What is (-?\d+)\s*([+\-*])\s*(-?\d+)\?$")
_FINAL_RE = re.compile(r"####\s*(-?\d+)\s*$")


def _apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"ops: unsupported operator {op!r} (use any of {_OPS!r})")


def generate_arithmetic(n: int, seed: int, max_operand: int = 99, ops: str = "+") -> list[dict]:
    """``n`` rows ``What is a<op>b?`` with 0 <= a, b <= max_operand, deterministic in ``seed``."""
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
        rows.append(
            {"id": f"arith-{seed}-{i:06d}", "question": f"What is {a}{op}{b}?", "answer": f"{a}{op}{b}={c}\n#### {c}"}
        )
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> None:
    """One JSON object per line (sorted keys, so the bytes are deterministic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    path.write_text(text)


def validate_row(row: object, where: str) -> dict:
    """Check one row; ``where`` (``path:LINE``) prefixes every error."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: row must be a JSON object, got {type(row).__name__}")
    for f in REQUIRED_FIELDS:
        if f not in row:
            raise ValueError(f"{where}: missing field {f!r}")
        if not isinstance(row[f], str):
            raise ValueError(f"{where}: field {f!r} must be a string, got {type(row[f]).__name__}")
    if not row["id"]:
        raise ValueError(f"{where}: field 'id' must not be empty")
    if not row["question"].strip():
        raise ValueError(f"{where}: field 'question' must not be empty")
    if _FINAL_RE.search(row["answer"]) is None:
        raise ValueError(f"{where}: field 'answer' must end with '#### <integer>', got {row['answer'][-40:]!r}")
    return row


def load_jsonl(path: str | Path) -> list[dict]:
    """Read and validate a dataset file; errors name ``path:LINE`` and the field.
    Blank lines are skipped; ids must be unique."""
    path = Path(path)
    rows: list[dict] = []
    seen: dict[str, int] = {}
    with path.open() as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            row = validate_row(obj, where)
            if row["id"] in seen:
                raise ValueError(f"{where}: field 'id' {row['id']!r} duplicates line {seen[row['id']]}")
            seen[row["id"]] = lineno
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: dataset is empty")
    return rows


def final_answer(row: dict) -> str:
    """The integer after ``####`` as a string (normalised: ``"007"`` -> ``"7"``)."""
    m = _FINAL_RE.search(row.get("answer", ""))
    if m is None:
        raise ValueError(f"row {row.get('id')!r}: field 'answer' must end with '#### <integer>'")
    return str(int(m.group(1)))


def prompt_text(row: dict) -> str:
    """What the policy sees: ``"23+45="`` for arithmetic rows, else question + ``"\\nAnswer: "``."""
    m = _QUESTION_RE.match(row["question"].strip())
    if m is not None:
        return f"{m.group(1)}{m.group(2)}{m.group(3)}="
    return row["question"].rstrip() + "\nAnswer: "


def sft_target(row: dict) -> str:
    """The SFT completion (EOS goes right after it): the bare final answer for
    arithmetic rows, the full answer text otherwise."""
    if _QUESTION_RE.match(row["question"].strip()) is not None:
        return final_answer(row)
    return row["answer"]


def prompt_order(n_rows: int, seed: int, epoch: int) -> list[int]:
    """A deterministic permutation of ``range(n_rows)`` for one epoch."""
    if n_rows <= 0:
        raise ValueError(f"n_rows must be > 0, got {n_rows}")
    if epoch < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    order = list(range(n_rows))
    random.Random(derive_seed("prompt_order", seed, epoch)).shuffle(order)
    return order


def prompts_for_step(n_rows: int, seed: int, cursor: int, count: int) -> list[int]:
    """Dataset indices at global positions ``cursor .. cursor+count-1``; position
    ``p`` is ``prompt_order(n_rows, seed, p // n_rows)[p % n_rows]``."""
    if cursor < 0:
        raise ValueError(f"cursor must be >= 0, got {cursor}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    out: list[int] = []
    cache: dict[int, list[int]] = {}
    for pos in range(cursor, cursor + count):
        epoch = pos // n_rows
        if epoch not in cache:
            cache[epoch] = prompt_order(n_rows, seed, epoch)
        out.append(cache[epoch][pos % n_rows])
    return out


def encode_prompt(tokenizer: Tokenizer, row: dict) -> list[int]:
    """Token ids of ``prompt_text(row)`` with BOS first: what engines and SFT both feed the model."""
    return tokenizer.encode(prompt_text(row), add_bos=True)
