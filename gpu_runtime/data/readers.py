"""Read a user's JSONL or Parquet dataset into normalized rows (``rows.DataRow``).

Columns are mapped by the run config's ``data`` section (``spec.data.DataSpec``):
the prompt comes from ``messages_key`` when set (a chat), else from
``prompt_key``; the label from ``label_key``; the id from ``id_key`` (a missing
or null id, or ``id_key: null``, gives ``row-<index>``, the 0-based position in
the dataset); ``metadata_keys`` are copied into ``metadata``. Integer ids and
labels become strings.

Every row is validated. Errors name the place: ``path:LINE`` (1-based line) for
JSONL, ``path:row N`` (0-based, as pyarrow / pandas index it) for Parquet, then
the field and what is wrong. Up to ``MAX_ERRORS`` are collected and raised
together as one ``DatasetError``. JSONL is streamed line by line, Parquet by
record batches (only the needed columns). Torch-free; pyarrow is imported only
for Parquet.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from gpu_runtime.data.rows import DataRow, int_answer
from spec.data import DataSpec

MAX_ERRORS = 10
_BATCH_ROWS = 1024


class DatasetError(ValueError):
    """Bad rows (or an unreadable file): one line per problem, each naming its place."""

    def __init__(self, errors: list[str], truncated: bool = False) -> None:
        self.errors = list(errors)
        self.truncated = truncated
        tail = [f"(stopped after {MAX_ERRORS} errors; the rest of the file was not checked)"] if truncated else []
        super().__init__("\n".join(self.errors + tail))


class _Bad:
    """A record that could not be parsed at all (invalid JSON, not an object)."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


def iter_rows(source: DataSpec, *, require_int_answer: bool) -> Iterator[dict]:
    """Normalized rows of a ``jsonl`` / ``parquet`` source, in file order. Bad rows
    are skipped and reported together: ``DatasetError`` after the last row, or at
    the ``MAX_ERRORS``-th problem. ``require_int_answer`` (``reward.kind:
    math_answer``) also rejects labels without an integer answer."""
    if source.kind not in ("jsonl", "parquet") or not source.path:
        raise ValueError(f"data: iter_rows reads a jsonl or parquet path, got kind {source.kind!r}")
    records = _jsonl_records(source.path) if source.kind == "jsonl" else _parquet_records(source)
    unit = "line" if source.kind == "jsonl" else "row"
    errors: list[str] = []
    seen: dict[str, str] = {}  # id -> "line 3" / "row 2"
    index = 0
    for where, pos, record in records:
        problems = [record.problem] if isinstance(record, _Bad) else []
        row = None if problems else _normalize(record, index, source, require_int_answer, problems)
        if row is not None:
            if row["id"] in seen:
                problems.append(f"field {_id_name(source)!r} {row['id']!r} duplicates {seen[row['id']]}")
            else:
                seen[row["id"]] = f"{unit} {pos}"
        index += 1
        if problems:
            errors.extend(f"{where}: {p}" for p in problems)
            if len(errors) >= MAX_ERRORS:
                raise DatasetError(errors[:MAX_ERRORS], truncated=True)
            continue
        assert row is not None
        yield row
    if errors:
        raise DatasetError(errors)
    if index == 0:
        raise DatasetError([f"{source.path}: dataset is empty (no rows)"])


def read_rows(source: DataSpec, *, require_int_answer: bool) -> list[dict]:
    """All rows of the source, validated (``DatasetError`` on bad ones)."""
    return list(iter_rows(source, require_int_answer=require_int_answer))


def check_source(source: DataSpec, *, require_int_answer: bool) -> int:
    """Validate the whole source without keeping its rows; the row count."""
    return sum(1 for _ in iter_rows(source, require_int_answer=require_int_answer))


# ---- records --------------------------------------------------------------------------
def _jsonl_records(path: str) -> Iterator[tuple[str, int, Any]]:
    """(``path:LINE``, LINE, object or _Bad) per non-blank line."""
    with Path(path).open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield where, lineno, _Bad("line is not UTF-8 text")
                continue
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                yield where, lineno, _Bad(f"invalid JSON ({e.msg})")
                continue
            yield where, lineno, obj if isinstance(obj, dict) else _Bad(
                f"row must be a JSON object, got {type(obj).__name__}"
            )


def _parquet_records(source: DataSpec) -> Iterator[tuple[str, int, Any]]:
    """(``path:row N``, N, dict) per row, read by record batches of the needed columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = source.path
    assert path is not None
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DatasetError([f"{path}: not a readable Parquet file ({e})"]) from None
    names = pf.schema_arrow.names
    wanted = [(source.messages_key, "data.messages_key")] if source.messages_key else [
        (source.prompt_key, "data.prompt_key")
    ]
    wanted += [(source.label_key, "data.label_key")] + [(k, "data.metadata_keys") for k in source.metadata_keys]
    missing = [f"{path}: column {k!r} ({what}) is missing" for k, what in wanted if k not in names]
    if missing:
        raise DatasetError(missing[:-1] + [f"{missing[-1]}; the file has columns {', '.join(names)}"])
    columns = list(dict.fromkeys([k for k, _ in wanted] + ([source.id_key] if source.id_key in names else [])))
    index = 0
    try:
        for batch in pf.iter_batches(batch_size=_BATCH_ROWS, columns=columns):
            for record in batch.to_pylist():
                yield f"{path}:row {index}", index, record
                index += 1
    except pa.ArrowException as e:
        raise DatasetError([f"{path}:row {index}: cannot read the batch from here on ({e})"]) from None


# ---- one record -> one row ------------------------------------------------------------
def _id_name(source: DataSpec) -> str:
    return source.id_key or "id"


def _as_text(value: Any) -> Any:
    """Integer ids and labels become strings (bools stay, and are refused)."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def _normalize(
    record: dict, index: int, source: DataSpec, require_int_answer: bool, problems: list[str]
) -> dict | None:
    """The row as a ``DataRow`` dict, or None with ``problems`` filled in."""
    candidate: dict[str, Any] = {"metadata": {}}
    raw_id = record.get(source.id_key) if source.id_key else None
    candidate["id"] = f"row-{index}" if raw_id is None else _as_text(raw_id)
    field, key = ("messages", source.messages_key) if source.messages_key else ("prompt", source.prompt_key)
    required: list[tuple[str | None, str, str]] = [(field, key, f"data.{field}_key"),
                                                   ("answer", source.label_key, "data.label_key")]
    required += [(None, k, "data.metadata_keys") for k in source.metadata_keys]
    for target, name, what in required:
        if name not in record:
            problems.append(f"missing field {name!r} ({what})")
        elif target is None:  # metadata: any JSON value, null included
            candidate["metadata"][name] = record[name]
        elif record[name] is None:
            problems.append(f"field {name!r} is null ({what})")
        else:
            candidate[target] = _as_text(record[name]) if target == "answer" else record[name]
    if problems:
        return None
    try:
        row = DataRow.model_validate(candidate)
    except ValidationError as err:
        problems.extend(_describe(e, source) for e in err.errors())
        return None
    if require_int_answer and int_answer(row.answer) is None:
        problems.append(
            f"field {source.label_key!r} has no integer answer, which reward.kind math_answer needs "
            f"('#### <integer>' at the end, or an integer): {row.answer[-40:]!r}"
        )
        return None
    return row.model_dump()


def _describe(e: Any, source: DataSpec) -> str:
    """One pydantic error as ``field 'KEY[1].role': what is wrong``, in the user's key names."""
    loc = list(e["loc"])
    head = loc[0] if loc else ""
    name = {
        "id": _id_name(source), "prompt": source.prompt_key, "messages": source.messages_key or "messages",
        "answer": source.label_key, "metadata": "metadata",
    }.get(str(head), str(head))
    path = name + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    value = e.get("input")
    kind = e["type"]
    if value is None and kind.endswith("_type"):
        what = "is null"
    elif kind == "string_type":
        allowed = "a string or an integer" if head in ("id", "answer") else "a string"
        what = f"must be {allowed}, got {type(value).__name__}"
    elif kind == "list_type":
        what = f"must be a list of {{role, content}} messages, got {type(value).__name__}"
    elif kind == "model_type":
        what = f"must be an object with 'role' and 'content', got {type(value).__name__}"
    elif kind == "missing":
        what = "is missing"
    elif kind == "extra_forbidden":
        what = "unknown key (a message holds only 'role' and 'content')"
    elif kind == "string_too_short":
        what = "must not be empty"
    else:
        what = str(e["msg"]).removeprefix("Value error, ")
    return f"field {path!r}: {what}"
