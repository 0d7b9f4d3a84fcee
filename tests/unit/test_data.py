"""Arithmetic dataset format, validation errors and deterministic prompt order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpu_runtime.data.datasets import (
    encode_prompt, final_answer, generate_arithmetic, load_jsonl, prompt_order, prompt_text, prompts_for_step,
    sft_target, write_jsonl,
)
from tests.engine_fixtures import _tokenizer


def test_generate_format_and_characters() -> None:
    rows = generate_arithmetic(50, seed=3, max_operand=99, ops="+-*")
    assert len({r["id"] for r in rows}) == 50
    for r in rows:
        a_op_b = prompt_text(r)[:-1]
        value = eval(a_op_b)  # noqa: S307 - our own generated "a+b"
        assert r["answer"].endswith(f"#### {value}")
        assert final_answer(r) == str(value)
        assert sft_target(r) == str(value)
    row = {"id": "x", "question": "What is 23+45?", "answer": "23+45=68\n#### 68"}
    assert prompt_text(row) == "23+45="
    assert sft_target(row) == "68"
    tok = _tokenizer()
    assert tok.decode(encode_prompt(tok, row)) == "23+45="  # no BOS: the tokenizer has none


def test_generate_is_deterministic_and_seed_dependent() -> None:
    assert generate_arithmetic(20, seed=1) == generate_arithmetic(20, seed=1)
    assert generate_arithmetic(20, seed=1) != generate_arithmetic(20, seed=2)


def test_non_arithmetic_rows_use_full_answer() -> None:
    row = {"id": "g1", "question": "Tom has 3 apples and buys 2. How many?", "answer": "3+2=5\n#### 5"}
    assert prompt_text(row) == "Tom has 3 apples and buys 2. How many?\nAnswer: "
    assert sft_target(row) == "3+2=5\n#### 5"


def test_jsonl_round_trip(tmp_path: Path) -> None:
    rows = generate_arithmetic(10, seed=0)
    path = tmp_path / "d" / "train.jsonl"
    write_jsonl(rows, path)
    assert load_jsonl(path) == rows


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"id": "b", "question": "q?"}), "missing field 'answer'"),
        (json.dumps({"id": "b", "question": "q?", "answer": "x\n#### 1.5"}), "field 'answer'"),
        (json.dumps({"id": "b", "question": "q?", "answer": 5}), "field 'answer' must be a string"),
        (json.dumps({"id": "a0", "question": "q?", "answer": "#### 1"}), "duplicates line 1"),
        (json.dumps([1, 2]), "JSON object"),
    ],
)
def test_bad_row_names_path_and_line(tmp_path: Path, line: str, needle: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"id": "a0", "question": "What is 1+1?", "answer": "1+1=2\n#### 2"})
    path.write_text(good + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:3: .*{needle}") as exc:
        load_jsonl(path)
    assert str(path) + ":3" in str(exc.value)


def test_empty_file_rejected(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        load_jsonl(path)


def test_prompt_order_is_a_deterministic_permutation() -> None:
    o = prompt_order(10, seed=5, epoch=0)
    assert sorted(o) == list(range(10))
    assert o == prompt_order(10, seed=5, epoch=0)
    assert o != prompt_order(10, seed=5, epoch=1)
    assert o != prompt_order(10, seed=6, epoch=0)


def test_prompts_for_step_crosses_epochs() -> None:
    n = 7
    allpos = prompts_for_step(n, seed=1, cursor=0, count=3 * n)
    for e in range(3):
        epoch = allpos[e * n : (e + 1) * n]
        assert sorted(epoch) == list(range(n))  # no repeats inside an epoch
        assert epoch == prompt_order(n, 1, e)
    # a window spanning the epoch boundary equals the concatenation
    assert prompts_for_step(n, 1, cursor=5, count=4) == allpos[5:9]
    # stepping in chunks gives the same stream
    chunks = [i for c in range(0, 3 * n, 4) for i in prompts_for_step(n, 1, c, min(4, 3 * n - c))]
    assert chunks == allpos


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="n_rows"):
        prompt_order(0, 1, 0)
    with pytest.raises(ValueError, match="cursor"):
        prompts_for_step(5, 1, -1, 2)
    with pytest.raises(ValueError, match="ops"):
        generate_arithmetic(3, 0, ops="/")
