"""The built-in arithmetic rows (byte-identical to the generator before normalized
rows), the run's dataset file, and the deterministic prompt order."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from gpu_runtime.data.datasets import (
    encode_prompt, final_answer, generate_arithmetic, load_jsonl, prompt_order, prompt_text, prompts_for_step,
    sft_target, write_jsonl,
)
from gpu_runtime.data.rows import DataRow
from tests.engine_fixtures import _tokenizer

# captured from the generator before rows were normalized (rows were {"id", "question", "answer"}):
# the equations it wrote, in order; ``old_rows`` spells out its format
OLD_SEED1_EQUATIONS = "1+55=56 0+47=47 87+91=178 16+10=26 80+80=160"
OLD_SEED7_OPS_EQUATIONS = "2-51=-49 52*89=4628 47-58=-11 68+71=139 73-48=25 92*43=3956"


def old_rows(seed: int, equations: str) -> list[tuple[str, str, str, str, str]]:
    """The old generator's rows as (id, old question, prompt_text, sft_target, answer)."""
    rows = []
    for i, eq in enumerate(equations.split()):
        expr, value = eq.split("=", 1)
        rows.append((f"arith-{seed}-{i:06d}", f"What is {expr}?", f"{expr}=", value, f"{eq}\n#### {value}"))
    return rows


OLD_SEED1 = old_rows(1, OLD_SEED1_EQUATIONS)
OLD_SEED7_OPS = old_rows(7, OLD_SEED7_OPS_EQUATIONS)

# sha256 of json.dumps([[id, prompt_text, sft_target, final_answer] ...]) over generate_arithmetic(2000, 1),
# the demo config's dataset, computed with the old generator
OLD_2000_SEED1_SHA = "ceae6f050ebb9530bc72cc87cec1ea1c25b80bea21f908b28aa5668f0d4f89be"
OLD_500_SEED3_OPS_SHA = "b94e973d2abe55463f0e7903be6f34b02fa80522e415dfb06e9c4c08067cd346"


def _digest(rows: list[dict]) -> str:
    return hashlib.sha256(
        json.dumps([[r["id"], prompt_text(r), sft_target(r), final_answer(r)] for r in rows]).encode()
    ).hexdigest()


@pytest.mark.parametrize(("rows", "old"), [
    (generate_arithmetic(5, seed=1), OLD_SEED1),
    (generate_arithmetic(6, seed=7, max_operand=99, ops="+-*"), OLD_SEED7_OPS),
])
def test_arithmetic_rows_are_byte_identical_to_before(rows: list[dict], old: list[tuple]) -> None:
    for row, (rid, _question, prompt, target, answer) in zip(rows, old, strict=True):
        assert row == {"id": rid, "prompt": prompt, "messages": None, "answer": answer, "metadata": {}}
        assert (prompt_text(row), sft_target(row), final_answer(row)) == (prompt, target, target)
        assert DataRow.model_validate(row).model_dump() == row


def test_arithmetic_prompts_and_targets_match_the_old_generator_in_bulk() -> None:
    assert _digest(generate_arithmetic(2000, seed=1)) == OLD_2000_SEED1_SHA
    assert _digest(generate_arithmetic(500, seed=3, max_operand=50, ops="+-*")) == OLD_500_SEED3_OPS_SHA


def test_generate_format_and_characters() -> None:
    rows = generate_arithmetic(50, seed=3, max_operand=99, ops="+-*")
    assert len({r["id"] for r in rows}) == 50
    for r in rows:
        value = eval(prompt_text(r)[:-1])  # noqa: S307 - our own generated "a+b"
        assert r["answer"].endswith(f"#### {value}")
        assert final_answer(r) == sft_target(r) == str(value)
    tok = _tokenizer()
    row = generate_arithmetic(1, seed=1)[0]
    assert tok.decode(encode_prompt(tok, row)) == "1+55="  # no BOS: the tokenizer has none


def test_generate_is_deterministic_and_seed_dependent() -> None:
    assert generate_arithmetic(20, seed=1) == generate_arithmetic(20, seed=1)
    assert generate_arithmetic(20, seed=1) != generate_arithmetic(20, seed=2)


def test_dataset_file_round_trip(tmp_path: Path) -> None:
    rows = generate_arithmetic(10, seed=0)
    path = tmp_path / "d" / "train.jsonl"
    assert write_jsonl(iter(rows), path) == 10
    assert load_jsonl(path) == rows


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"id": "b", "prompt": "q?"}), "answer: Field required"),
        (json.dumps({"id": "b", "prompt": "q?", "answer": 5}), "answer: Input should be a valid string"),
        (json.dumps({"id": "a0", "prompt": "q?", "answer": "1"}), "duplicates line 1"),
        (json.dumps({"id": "b", "answer": "1"}), "exactly one of 'prompt' and 'messages'"),
    ],
)
def test_bad_dataset_file_names_path_and_line(tmp_path: Path, line: str, needle: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"id": "a0", "prompt": "1+1=", "messages": None, "answer": "1+1=2\n#### 2", "metadata": {}})
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


def test_messages_row_is_rendered_by_the_models_chat_template() -> None:
    tok = _tokenizer()
    row = {"id": "c0", "prompt": None, "messages": [{"role": "system", "content": "Add."},
                                                    {"role": "user", "content": "23+45?"}],
           "answer": "68", "metadata": {}}
    ids = encode_prompt(tok, row)
    assert tok.decode(ids, skip_special=False) == (
        "<|startoftext|><|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n23+45?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1  # the template's BOS, not a second one
    assert ids[1] == tok.hf.convert_tokens_to_ids("<|im_start|>")  # a special token, not its characters
