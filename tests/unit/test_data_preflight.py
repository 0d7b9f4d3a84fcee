"""`milestone start` reads and validates the whole dataset before it connects:
a bad row exits 2 with its file:line / file:row, naming the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from milestone_cli.config_file import load_run_config

ROOT = Path(__file__).resolve().parents[2]


def start_offline(tmp_path: Path, data: dict, reward: dict | None = None) -> subprocess.CompletedProcess:
    """`milestone start` against an address where nothing listens: pre-flight must decide first."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"steps: 2\nstore: file://{tmp_path}/store\ndata: {json.dumps(data)}\n"
                   f"reward: {json.dumps(reward or {'kind': 'math_answer'})}\n")
    return subprocess.run(
        [sys.executable, "-m", "milestone_cli.main", "--address", "127.0.0.1:1", "start", str(cfg)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )


def test_bad_parquet_row_exits_2_before_connecting(tmp_path: Path) -> None:
    src = tmp_path / "train.parquet"
    pq.write_table(pa.table({"id": ["a", "b", "c"], "question": ["1+1?", " ", "2+2?"],
                             "answer": ["#### 2", "#### 3", "four"]}), src)
    out = start_offline(tmp_path, {"kind": "parquet", "path": str(src)})
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        f"error: {src}:row 1: field 'question': must not be empty",
        f"{src}:row 2: field 'answer' has no integer answer, which reward.kind math_answer needs "
        "('#### <integer>' at the end, or an integer): 'four'",
    ]
    assert not (tmp_path / "store").exists()


def test_bad_jsonl_messages_row_exits_2(tmp_path: Path) -> None:
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"id": "c", "chat": [{"role": "user", "text": "hi"}], "answer": "5"}) + "\n")
    out = start_offline(tmp_path, {"kind": "jsonl", "path": str(src), "messages_key": "chat"})
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == [
        f"error: {src}:1: field 'chat[0].content': is missing",
        f"{src}:1: field 'chat[0].text': unknown key (a message holds only 'role' and 'content')",
    ]


def test_missing_dataset_file_exits_2(tmp_path: Path) -> None:
    out = start_offline(tmp_path, {"kind": "jsonl", "path": str(tmp_path / "nope.jsonl")})
    assert out.returncode == 2
    assert out.stderr.startswith("error: data.path: ") and "nope.jsonl" in out.stderr


def test_good_dataset_passes_preflight(tmp_path: Path) -> None:
    src = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["Capital of France?"], "answer": ["Paris"]}), src)
    reward = {"kind": "custom", "function": "tests.reward_fns:length_reward"}  # text labels are fine
    out = start_offline(tmp_path, {"kind": "parquet", "path": str(src)}, reward)
    # past pre-flight: it fails only on the unreachable Temporal address
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith("error: cannot reach Temporal at 127.0.0.1:1")


def test_relative_data_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control worker reads the file again in prepare_data, from wherever it runs."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("data: {kind: jsonl, path: data/train.jsonl, eval_path: data/test.jsonl}\n")
    monkeypatch.chdir(tmp_path)
    data = load_run_config(cfg).data
    assert (data.path, data.eval_path) == (str(tmp_path / "data" / "train.jsonl"), str(tmp_path / "data" / "test.jsonl"))


def test_bad_eval_row_exits_2(tmp_path: Path) -> None:
    """The eval split is checked like the train set, with integer answers whatever the reward."""
    train, held = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text('{"id": "a", "question": "Capital of France?", "answer": "Paris"}\n')
    held.write_text('{"id": "h", "question": "2+2?", "answer": "four"}\n')
    reward = {"kind": "custom", "function": "tests.reward_fns:length_reward"}
    out = start_offline(tmp_path, {"kind": "jsonl", "path": str(train), "eval_path": str(held)}, reward)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"error: {held}:1: field 'answer' has no integer answer")
    out = start_offline(tmp_path, {"kind": "jsonl", "path": str(train), "eval_path": str(tmp_path / "nope.jsonl")}, reward)
    assert out.returncode == 2 and out.stderr.startswith("error: data.eval_path: ")
