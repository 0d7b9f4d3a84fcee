"""Reading users' JSONL and Parquet datasets into normalized rows: key mapping,
metadata, messages rows, GSM8K labels, and every kind of bad row with its place."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gpu_runtime.data.readers import MAX_ERRORS, DatasetError, check_source, iter_rows, read_rows
from gpu_runtime.data.rows import DataRow
from spec.data import DataSpec

GSM = "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?"
CHAT = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2+3?"}]


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def write_parquet(path: Path, columns: dict[str, list], schema: pa.Schema | None = None) -> Path:
    pq.write_table(pa.table(columns, schema=schema), path, row_group_size=2)  # several batches / row groups
    return path


def read(path: Path, math: bool = True, **data: Any) -> list[dict]:
    kind = "parquet" if path.suffix == ".parquet" else "jsonl"
    return read_rows(DataSpec(kind=kind, path=str(path), **data), require_int_answer=math)


def errors(path: Path, math: bool = True, **data: Any) -> list[str]:
    with pytest.raises(DatasetError) as err:
        read(path, math, **data)
    return str(err.value).splitlines()


# ---- good rows --------------------------------------------------------------------------------
def test_jsonl_default_keys_gsm8k_style(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "gsm8k.jsonl", [
        {"id": "g0", "question": GSM, "answer": "48/2 = <<48/2=24>>24\n#### 72"},
        {"id": "g1", "question": "2+2?", "answer": 4, "extra": "ignored"},
    ])
    assert read(p) == [
        {"id": "g0", "prompt": GSM, "messages": None, "answer": "48/2 = <<48/2=24>>24\n#### 72", "metadata": {}},
        {"id": "g1", "prompt": "2+2?", "messages": None, "answer": "4", "metadata": {}},
    ]


def test_jsonl_custom_keys_metadata_and_generated_ids(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "custom.jsonl", [
        {"input": "Say hi", "label": "hi", "source": "web", "tags": ["a", "b"]},
        {"input": "Say bye", "label": "bye", "source": None, "tags": []},
    ])
    rows = read(p, math=False, prompt_key="input", label_key="label", metadata_keys=["source", "tags"])
    assert [r["id"] for r in rows] == ["row-0", "row-1"]  # no 'id' key: 0-based positions
    assert rows[0]["metadata"] == {"source": "web", "tags": ["a", "b"]}
    assert rows[1]["metadata"] == {"source": None, "tags": []}
    assert [r["prompt"] for r in read(p, math=False, prompt_key="input", label_key="label", id_key=None)] == [
        "Say hi", "Say bye"
    ]


def test_jsonl_messages_rows(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "chat.jsonl", [{"id": 7, "conversation": CHAT, "question": "unused", "answer": "5"}])
    (r,) = read(p, messages_key="conversation")  # messages_key wins over prompt_key
    assert r == {"id": "7", "prompt": None, "messages": CHAT, "answer": "5", "metadata": {}}


def test_jsonl_blank_lines_skipped_and_index_counts_rows(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "gaps.jsonl", [{"question": "a", "answer": "1"}, "", "  ", {"question": "b", "answer": "2"}])
    assert [r["id"] for r in read(p)] == ["row-0", "row-1"]


def test_parquet_default_keys_metadata_and_batches(tmp_path: Path) -> None:
    n = 5
    p = write_parquet(tmp_path / "train.parquet", {
        "id": [f"p{i}" for i in range(n)], "question": [f"q{i}?" for i in range(n)],
        "answer": [f"so\n#### {i}" for i in range(n)], "level": list(range(n)), "unused": [b"x"] * n,
    })
    rows = read(p, metadata_keys=["level"])
    assert [r["id"] for r in rows] == [f"p{i}" for i in range(n)]
    assert rows[3] == {"id": "p3", "prompt": "q3?", "messages": None, "answer": "so\n#### 3", "metadata": {"level": 3}}
    assert all(DataRow.model_validate(r).model_dump() == r for r in rows)


def test_parquet_messages_int_labels_and_generated_ids(tmp_path: Path) -> None:
    p = write_parquet(tmp_path / "chat.parquet", {"messages": [CHAT, CHAT[1:]], "label": [5, -1]})
    rows = read(p, messages_key="messages", label_key="label")
    assert [(r["id"], r["messages"], r["answer"]) for r in rows] == [("row-0", CHAT, "5"), ("row-1", CHAT[1:], "-1")]


def test_parquet_integer_ids_become_strings(tmp_path: Path) -> None:
    p = write_parquet(tmp_path / "ids.parquet", {"uid": [10, 11], "question": ["a", "b"], "answer": ["1", "2"]})
    assert [r["id"] for r in read(p, id_key="uid")] == ["10", "11"]


def test_custom_reward_allows_text_labels(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "text.jsonl", [{"id": "t", "question": "Capital of France?", "answer": "Paris"}])
    assert read(p, math=False)[0]["answer"] == "Paris"
    assert errors(p, math=True) == [
        f"{p}:1: field 'answer' has no integer answer, which reward.kind math_answer needs "
        "('#### <integer>' at the end, or an integer): 'Paris'"
    ]


def test_check_source_counts_and_iter_rows_streams(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "s.jsonl", [{"question": f"q{i}", "answer": str(i)} for i in range(25)])
    source = DataSpec(kind="jsonl", path=str(p))
    assert check_source(source, require_int_answer=True) == 25
    it = iter_rows(source, require_int_answer=True)
    assert next(it)["id"] == "row-0"  # rows come before the file is finished


# ---- bad rows: JSONL (1-based lines) ----------------------------------------------------------
def test_jsonl_errors_are_collected_with_line_and_field(tmp_path: Path) -> None:
    good = {"id": "a0", "question": "1+1?", "answer": "#### 2"}
    p = write_jsonl(tmp_path / "bad.jsonl", [
        good,                                                         # 1
        "{not json",                                                  # 2
        {"id": "b", "answer": "1"},                                   # 3 missing prompt
        {"id": "c", "question": 12, "answer": "1"},                   # 4 wrong type
        {"id": "d", "question": "   ", "answer": "1"},                # 5 empty prompt
        {"id": "e", "question": "q", "answer": "about five"},         # 6 no integer answer
        {"id": "a0", "question": "q", "answer": "1"},                 # 7 duplicate id
        [1, 2],                                                       # 8 not an object
        {"id": "f", "question": "q", "answer": True},                 # 9 bool label
        {"id": "g", "question": None, "answer": "1"},                 # 10 null
    ])
    assert errors(p) == [
        f"{p}:2: invalid JSON (Expecting property name enclosed in double quotes)",
        f"{p}:3: missing field 'question' (data.prompt_key)",
        f"{p}:4: field 'question': must be a string, got int",
        f"{p}:5: field 'question': must not be empty",
        f"{p}:6: field 'answer' has no integer answer, which reward.kind math_answer needs "
        "('#### <integer>' at the end, or an integer): 'about five'",
        f"{p}:7: field 'id' 'a0' duplicates line 1",
        f"{p}:8: row must be a JSON object, got list",
        f"{p}:9: field 'answer': must be a string or an integer, got bool",
        f"{p}:10: field 'question' is null (data.prompt_key)",
    ]


@pytest.mark.parametrize(
    ("conversation", "needle"),
    [
        ("hello", "field 'conversation': must be a list of {role, content} messages, got str"),
        ([], "field 'conversation': must hold at least one message"),
        (["hi"], "field 'conversation[0]': must be an object with 'role' and 'content', got str"),
        ([{"role": "user"}], "field 'conversation[0].content': is missing"),
        ([{"role": "user", "content": 3}], "field 'conversation[0].content': must be a string, got int"),
        ([{"role": "", "content": "x"}], "field 'conversation[0].role': must not be empty"),
        ([{"role": "user", "content": "x", "name": "bob"}],
         "field 'conversation[0].name': unknown key (a message holds only 'role' and 'content')"),
        ([{"role": "user", "content": ""}], "field 'conversation': every message's content is empty"),
    ],
)
def test_malformed_messages(tmp_path: Path, conversation: Any, needle: str) -> None:
    p = write_jsonl(tmp_path / "chat.jsonl", [{"id": "x", "conversation": conversation, "answer": "1"}])
    assert errors(p, messages_key="conversation") == [f"{p}:1: {needle}"]


def test_metadata_errors(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "m.jsonl", [{"question": "q", "answer": "1"}])
    assert errors(p, metadata_keys=["source"]) == [f"{p}:1: missing field 'source' (data.metadata_keys)"]


def test_error_collection_stops_at_max_errors(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "many.jsonl", [{"id": str(i), "answer": "1"} for i in range(50)])
    lines = errors(p)
    assert len(lines) == MAX_ERRORS + 1
    assert lines[MAX_ERRORS - 1] == f"{p}:{MAX_ERRORS}: missing field 'question' (data.prompt_key)"
    assert lines[-1] == f"(stopped after {MAX_ERRORS} errors; the rest of the file was not checked)"


def test_not_utf8_and_empty_and_missing_files(tmp_path: Path) -> None:
    p = tmp_path / "bin.jsonl"
    p.write_bytes(json.dumps({"question": "a", "answer": "1"}).encode() + b"\n\xff\xfe\n")
    assert errors(p) == [f"{p}:2: line is not UTF-8 text"]
    empty = write_jsonl(tmp_path / "empty.jsonl", [""])
    assert errors(empty) == [f"{empty}: dataset is empty (no rows)"]
    with pytest.raises(FileNotFoundError):
        read(tmp_path / "nope.jsonl")


# ---- bad rows: Parquet (0-based rows) ---------------------------------------------------------
def test_parquet_row_errors_name_the_row(tmp_path: Path) -> None:
    p = write_parquet(tmp_path / "bad.parquet", {
        "id": ["a", "b", "c", "a", None],
        "question": ["q", "", "q", "q", "q"],
        "answer": ["#### 1", "#### 2", "three", "#### 4", None],
    })
    assert errors(p) == [
        f"{p}:row 1: field 'question': must not be empty",
        f"{p}:row 2: field 'answer' has no integer answer, which reward.kind math_answer needs "
        "('#### <integer>' at the end, or an integer): 'three'",
        f"{p}:row 3: field 'id' 'a' duplicates row 0",
        f"{p}:row 4: field 'answer' is null (data.label_key)",
    ]


def test_parquet_wrong_column_types_and_bad_messages(tmp_path: Path) -> None:
    p = write_parquet(tmp_path / "types.parquet", {"question": [1.5, 2.5], "answer": [1.0, 2.0]})
    assert errors(p) == [
        f"{p}:row 0: field 'question': must be a string, got float",
        f"{p}:row 0: field 'answer': must be a string or an integer, got float",
        f"{p}:row 1: field 'question': must be a string, got float",
        f"{p}:row 1: field 'answer': must be a string or an integer, got float",
    ]
    schema = pa.schema([("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
                        ("answer", pa.string())])
    chat = write_parquet(tmp_path / "chat.parquet", {
        "messages": [CHAT, [{"role": "user", "content": None}]], "answer": ["5", "6"],
    }, schema)
    assert errors(chat, messages_key="messages") == [f"{chat}:row 1: field 'messages[0].content': is null"]


def test_parquet_missing_columns_reported_once(tmp_path: Path) -> None:
    p = write_parquet(tmp_path / "cols.parquet", {"prompt": ["a"], "label": ["1"]})
    assert errors(p, metadata_keys=["src"]) == [
        f"{p}: column 'question' (data.prompt_key) is missing",
        f"{p}: column 'answer' (data.label_key) is missing",
        f"{p}: column 'src' (data.metadata_keys) is missing; the file has columns prompt, label",
    ]


def test_not_a_parquet_file(tmp_path: Path) -> None:
    p = tmp_path / "fake.parquet"
    p.write_text("not parquet\n")
    (line,) = errors(p)
    assert line.startswith(f"{p}: not a readable Parquet file (")


# ---- config -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"kind": "parquet"}, "path is required when kind is 'parquet'"),
        ({"kind": "parquet", "path": "d.jsonl"}, "must end with .parquet or .pq for kind 'parquet'"),
        ({"kind": "jsonl", "path": "d.parquet"}, "must end with .jsonl or .ndjson or .json for kind 'jsonl'"),
        ({"metadata_keys": ["a", "a"]}, "keys must be unique"),
        ({"prompt_key": ""}, "prompt_key"),
        ({"input_key": "q"}, "Extra inputs are not permitted"),
    ],
)
def test_data_spec_validation(data: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        DataSpec(**data)


def test_data_spec_defaults_keep_the_old_jsonl_keys() -> None:
    d = DataSpec(kind="jsonl", path="x.JSONL")
    assert (d.prompt_key, d.messages_key, d.label_key, d.id_key, d.metadata_keys) == (
        "question", None, "answer", "id", []
    )
