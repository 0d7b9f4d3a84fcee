"""``prepare_data`` on a real local store, run in Temporal's activity test environment: a bad
dataset row fails the run (InvalidInput, not retried); the held-out eval split. (The reward
activity: tests/unit/test_reward_activity.py.)"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.control import prepare_data
from gpu_runtime.data.datasets import load_jsonl
from spec.data import DataSpec
from spec.reward import RewardSpec
from spec.run import EvalSpec
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.uri import open_store
from workflows.contracts.placement import DatasetInfo, PrepareDataInput
from workflows.failures import Failure

# ---- prepare_data on a user's dataset ---------------------------------------------------------
def prepare(
    tmp_path: Path, data: DataSpec, reward: RewardSpec | None = None, eval_spec: EvalSpec | None = None
) -> DatasetInfo:
    inp = PrepareDataInput(run_id="u", store_uri=f"file://{tmp_path / 'store'}", seed=1, data=data,
                           reward=reward or RewardSpec(), eval=eval_spec or EvalSpec())
    return ActivityEnvironment().run(prepare_data, inp)


def test_prepare_data_writes_normalized_rows_from_parquet(tmp_path: Path) -> None:
    src = tmp_path / "train.parquet"
    pq.write_table(pa.table({"uid": [3, 4], "text": ["Say 7", "Say 8"], "label": ["#### 7", "8"],
                             "src": ["a", "b"]}), src)
    info = prepare(tmp_path, DataSpec(kind="parquet", path=str(src), prompt_key="text", label_key="label",
                                      id_key="uid", metadata_keys=["src"]))
    assert info.n_rows == 2
    with tempfile.TemporaryDirectory() as tmp:
        open_store(f"file://{tmp_path / 'store'}").get_file(info.key, Path(tmp) / "d.jsonl")
        rows = load_jsonl(Path(tmp) / "d.jsonl")
    assert rows == [
        {"id": "3", "prompt": "Say 7", "messages": None, "answer": "#### 7", "metadata": {"src": "a"}},
        {"id": "4", "prompt": "Say 8", "messages": None, "answer": "8", "metadata": {"src": "b"}},
    ]


def test_prepare_data_bad_row_is_invalid_input_not_retried(tmp_path: Path) -> None:
    src = tmp_path / "bad.jsonl"
    src.write_text('{"id": "a", "question": "q", "answer": "#### 1"}\n{"id": "b", "question": "q", "answer": "x"}\n')
    with pytest.raises(ApplicationError) as err:
        prepare(tmp_path, DataSpec(kind="jsonl", path=str(src)))
    assert err.value.type == Failure.INVALID_INPUT and err.value.non_retryable
    assert err.value.message.startswith(f"{src}:2: field 'answer' has no integer answer")
    assert not open_store(f"file://{tmp_path / 'store'}").exists(art.dataset_key("u", "train"))
    # a custom reward takes any text label
    assert prepare(tmp_path, DataSpec(kind="jsonl", path=str(src)), RewardSpec(kind="custom", function="m:f")).n_rows == 2


def test_prepare_data_missing_file_is_invalid_input(tmp_path: Path) -> None:
    with pytest.raises(ApplicationError) as err:
        prepare(tmp_path, DataSpec(kind="parquet", path=str(tmp_path / "nope.parquet")))
    assert err.value.type == Failure.INVALID_INPUT and err.value.message.startswith("data.path: ")


def stored_rows(tmp_path: Path, key: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        open_store(f"file://{tmp_path / 'store'}").get_file(key, Path(tmp) / "d.jsonl")
        return load_jsonl(Path(tmp) / "d.jsonl")


def test_prepare_data_writes_a_heldout_arithmetic_split(tmp_path: Path) -> None:
    """Unseen prompts of the same generator, none repeated; at most eval.n of them."""
    info = ActivityEnvironment().run(prepare_data, PrepareDataInput(
        run_id="u", store_uri=f"file://{tmp_path / 'store'}", seed=1, data=DataSpec(num_train=50, max_operand=9),
        eval=EvalSpec(n=20)))
    assert (info.eval_key, info.n_eval) == (art.dataset_key("u", "eval"), 20)
    held = [r["prompt"] for r in stored_rows(tmp_path, info.eval_key)]
    train = {r["prompt"] for r in stored_rows(tmp_path, info.key)}
    assert len(held) == len(set(held)) == 20 and not set(held) & train
    # 10 x 10 prompts, ~200 train draws cover most: the split gets what is left
    small = ActivityEnvironment().run(prepare_data, PrepareDataInput(
        run_id="v", store_uri=f"file://{tmp_path / 'store'}", seed=1, data=DataSpec(num_train=200, max_operand=9)))
    train = {r["prompt"] for r in stored_rows(tmp_path, small.key)}
    assert small.n_eval == 100 - len(train) > 0


def test_prepare_data_eval_split_from_eval_path_or_none(tmp_path: Path) -> None:
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text('{"id": "a", "question": "1+1", "answer": "2"}\n')
    held.write_text("".join(f'{{"id": "h{i}", "question": "{i}+1", "answer": "{i + 1}"}}\n' for i in range(5)))
    info = prepare(tmp_path, DataSpec(kind="jsonl", path=str(train), eval_path=str(held)), eval_spec=EvalSpec(n=3))
    assert info.n_eval == 3 and [r["id"] for r in stored_rows(tmp_path, info.eval_key)] == ["h0", "h1", "h2"]
    # no eval_path, or eval switched off: no split (the run records an eval_skipped event)
    cases = [("w", DataSpec(kind="jsonl", path=str(train)), EvalSpec()),
             ("x", DataSpec(kind="jsonl", path=str(train), eval_path=str(held)), EvalSpec(enabled=False))]
    for run_id, data, spec in cases:
        info = ActivityEnvironment().run(prepare_data, PrepareDataInput(
            run_id=run_id, store_uri=f"file://{tmp_path / 'store'}", seed=1, data=data, eval=spec))
        assert (info.eval_key, info.n_eval) == (None, 0)
        assert not open_store(f"file://{tmp_path / 'store'}").exists(art.dataset_key(run_id, "eval"))


def test_prepare_data_bad_eval_row_is_invalid_input(tmp_path: Path) -> None:
    """The eval scores with the math rule: its labels need an integer answer whatever the reward."""
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text('{"id": "a", "question": "q", "answer": "yes"}\n')
    held.write_text('{"id": "h", "question": "q", "answer": "no"}\n')
    with pytest.raises(ApplicationError) as err:
        prepare(tmp_path, DataSpec(kind="jsonl", path=str(train), eval_path=str(held)),
                RewardSpec(kind="custom", function="m:f"))
    assert err.value.type == Failure.INVALID_INPUT and err.value.message.startswith(f"{held}:1: field 'answer'")
    with pytest.raises(ApplicationError) as err:
        prepare(tmp_path, DataSpec(kind="jsonl", path=str(train), eval_path=str(tmp_path / "nope.jsonl")),
                RewardSpec(kind="custom", function="m:f"))
    assert err.value.message.startswith("data.eval_path: ")
