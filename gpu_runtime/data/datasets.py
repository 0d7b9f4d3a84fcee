"""The run's dataset file and the deterministic prompt order of a run.

``prepare_data`` writes the run's dataset to the store as JSONL, one normalized
row (``rows.DataRow``) per line; ``load_jsonl`` reads it back for the engines,
the trainer and the rewards. The row functions (``prompt_text``, ``sft_target``,
``final_answer``) live in ``rows``, the built-in generator in ``arithmetic``, the
readers of users' JSONL / Parquet files in ``readers``; they are re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import json
import random
from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError

from gpu_runtime.data.arithmetic import generate_arithmetic
from gpu_runtime.data.rows import DataRow, final_answer, prompt_messages, prompt_text, sft_target
from gpu_runtime.store.artifacts import derive_seed

if TYPE_CHECKING:  # the tokenizer pulls in transformers: not needed to read data
    from gpu_runtime.models.tokenizer import Tokenizer


__all__ = [
    "encode_prompt", "final_answer", "generate_arithmetic", "load_jsonl", "prompt_messages", "prompt_order",
    "prompt_text", "prompts_for_step", "sft_target", "write_jsonl",
]


def write_jsonl(rows: Iterable[dict], path: str | Path) -> int:
    """One JSON object per line (sorted keys, so the bytes are deterministic),
    written as the rows come; the number of rows."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with path.open("w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, sort_keys=True) + "\n")
            n += 1
    return n


def load_jsonl(path: str | Path) -> list[dict]:
    """Read the run's dataset file (normalized rows, as ``prepare_data`` writes
    it); a bad row is a ValueError naming ``path:LINE`` and the field. Blank
    lines are skipped; ids must be unique. To read a user's dataset, use
    ``readers.iter_rows``."""
    path = Path(path)
    rows: list[dict] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            try:
                row = DataRow.model_validate(obj).model_dump()
            except ValidationError as err:
                first = err.errors()[0]
                field = ".".join(str(p) for p in first["loc"]) or "row"
                raise ValueError(f"{where}: {field}: {first['msg'].removeprefix('Value error, ')}") from None
            if row["id"] in seen:
                raise ValueError(f"{where}: field 'id' {row['id']!r} duplicates line {seen[row['id']]}")
            seen[row["id"]] = lineno
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: dataset is empty")
    return rows


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
    """The prompt's token ids, what engines and SFT both feed the model: a ``messages``
    row through the model's chat template (with the generation prompt), a plain prompt
    as written (BOS first when the tokenizer has one)."""
    messages = prompt_messages(row)
    if messages is not None:
        return tokenizer.encode_chat(messages)
    return tokenizer.encode(prompt_text(row), add_bos=True)
