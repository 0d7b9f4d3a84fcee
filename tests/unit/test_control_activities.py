"""``compute_rewards`` and ``prepare_data`` on a real local store, run in Temporal's
activity test environment: a reward function that cannot be loaded fails the run
(InvalidInput, not retried); one that raises when called fails it too (RewardError, not
retried) or scores 0 (error_policy zero); an endpoint that is down is a retried RewardError;
a bad dataset row fails the run (InvalidInput, not retried); the held-out eval split."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.control import compute_rewards, prepare_data
from gpu_runtime.data.datasets import load_jsonl
from gpu_runtime.proc.processes import free_port
from spec.data import DataSpec
from spec.reward import RewardSpec
from spec.run import EvalSpec
from tests.engine_fixtures import _tokenizer
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.uri import open_store
from workflows.contracts.placement import DatasetInfo, PrepareDataInput
from workflows.contracts.sampling import RewardInput, RewardResult
from workflows.failures import Failure

FNS = "tests.reward_fns"  # light functions the reward process loads by dotted path


@pytest.fixture
def step_inputs(tmp_path: Path) -> tuple[str, DatasetInfo, str]:
    """A prepared dataset and one stored rollout chunk of two samples (step 1)."""
    uri = f"file://{tmp_path / 'store'}"
    data = ActivityEnvironment().run(
        prepare_data, PrepareDataInput(run_id="r", store_uri=uri, seed=1, data=DataSpec(num_train=4, max_operand=9))
    )
    tok = _tokenizer()
    samples = [
        art.Sample(sample_id=f"s1-p0-g{g}", prompt_index=0, group_index=g, prompt_ids=tok.encode("1+1="),
                   response_ids=tok.encode(text), logprobs=[0.0] * len(text), weight_version=0, finish_reason="stop",
                   prompt_text="1+1=", response_text=text)
        for g, text in enumerate(["2", "3"])
    ]
    key = art.rollout_chunk_key("r", 1, 0)
    art.put_model(open_store(uri), key, art.RolloutChunk(run_id="r", step=1, chunk=0, seed=1, weight_version=0,
                                                         samples=samples))
    return uri, data, key


def rewards(step_inputs: tuple[str, DatasetInfo, str], function: str, **reward: object) -> RewardResult:
    spec = RewardSpec(kind="custom", function=function, **reward) if function else RewardSpec(**reward)
    uri, data, key = step_inputs
    inp = RewardInput(run_id="r", step=1, store_uri=uri, chunk_keys=[key], dataset=data, reward=spec)
    return ActivityEnvironment().run(compute_rewards, inp)


def test_custom_reward_scores_every_sample(step_inputs: tuple[str, DatasetInfo, str]) -> None:
    result = rewards(step_inputs, f"{FNS}:constant_reward")
    assert result.n == 2 and result.reward_mean == 0.5


@pytest.mark.parametrize(
    ("function", "needle"),
    [
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        (f"{FNS}:missing", "has no callable 'missing'"),
        (f"{FNS}:NOT_CALLABLE", "is not callable (int)"),
    ],
)
def test_unloadable_reward_function_is_invalid_input(
    step_inputs: tuple[str, DatasetInfo, str], function: str, needle: str
) -> None:
    with pytest.raises(ApplicationError) as err:
        rewards(step_inputs, function)
    assert err.value.type == Failure.INVALID_INPUT and err.value.non_retryable
    assert err.value.message.startswith("reward.function: ") and needle in err.value.message


def test_raising_reward_function_fails_the_run_under_error_policy_fail(step_inputs: tuple[str, DatasetInfo, str]) -> None:
    with pytest.raises(ApplicationError) as err:
        rewards(step_inputs, f"{FNS}:raising_reward")
    assert err.value.type == Failure.REWARD_ERROR and err.value.non_retryable
    assert f"reward function '{FNS}:raising_reward' on sample s1-p0-g0 raised ZeroDivisionError: reward bug" \
        in err.value.message


def test_raising_reward_function_scores_zero_under_error_policy_zero(
    step_inputs: tuple[str, DatasetInfo, str]
) -> None:
    result = rewards(step_inputs, f"{FNS}:raising_reward", error_policy="zero")
    assert (result.n, result.reward_mean, result.errors) == (2, 0.0, 2)
    uri, _, _ = step_inputs
    stored = art.get_model(open_store(uri), result.rewards_key, art.StepRewards).rewards
    assert all("ZeroDivisionError: reward bug" in r.error for r in stored)


def test_unreachable_endpoint_is_a_retried_reward_error(step_inputs: tuple[str, DatasetInfo, str]) -> None:
    """Nothing listens on the port: the activity fails retryably (Temporal tries again)."""
    port = free_port()
    with pytest.raises(ApplicationError) as err:
        rewards(step_inputs, "", kind="http", url=f"http://127.0.0.1:{port}/score", max_retries=0)
    assert err.value.type == Failure.REWARD_ERROR and not err.value.non_retryable
    assert "failed 1 times" in err.value.message and "ConnectError" in err.value.message


def test_group_stats_are_reported_when_asked(step_inputs: tuple[str, DatasetInfo, str]) -> None:
    uri, data, key = step_inputs
    store = open_store(uri)
    chunk = art.get_model(store, key, art.RolloutChunk)
    right = stored_rows(Path(uri.removeprefix("file://")).parent, data.key)[0]["answer"].rpartition("#### ")[2]
    chunk.samples[0] = chunk.samples[0].model_copy(update={"response_text": right})
    art.put_model(store, key, chunk)
    inp = RewardInput(run_id="r", step=1, store_uri=uri, chunk_keys=[key], dataset=data, reward=RewardSpec(),
                      round=2, group_size=2)
    result = ActivityEnvironment().run(compute_rewards, inp)
    assert result.rewards_key == art.rewards_key("r", 1, 2) == "runs/r/steps/000001/round-02/rewards.json"
    assert (result.groups, result.varied_groups) == (1, [0])  # the first is right, "3" is wrong
    single = ActivityEnvironment().run(compute_rewards, inp.model_copy(update={"group_size": 1}))
    assert (single.groups, single.varied_groups, single.groups_all_correct, single.groups_all_wrong) == (2, [], 1, 1)


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


# ---- fencing: every write at the step's placement epoch --------------------------------------
def test_rewards_and_judge_records_of_a_left_behind_placement_are_refused(
    step_inputs: tuple[str, DatasetInfo, str],
) -> None:
    """Once the run has moved to a newer placement epoch, compute_rewards of the old one
    writes neither its rewards nor (``judge``) a single judge record: NodeLost."""
    from gpu_runtime.store.fence import raise_fence
    from tests.reward_servers import reward_server

    uri, data, key = step_inputs
    store = open_store(uri)
    raise_fence(store, "r", 1, "n0", from_step=1)
    raise_fence(store, "r", 2, "n1", from_step=1)
    stale = RewardInput(run_id="r", step=1, store_uri=uri, chunk_keys=[key], dataset=data, reward=RewardSpec(),
                        epoch=1)
    with pytest.raises(ApplicationError) as err:
        ActivityEnvironment().run(compute_rewards, stale)
    assert err.value.type == Failure.NODE_LOST and "stale placement" in err.value.message
    assert not store.exists(art.rewards_key("r", 1))
    with reward_server() as server:
        judged = stale.model_copy(update={"reward": RewardSpec(kind="judge", url=server.url, max_retries=0)})
        with pytest.raises(ApplicationError) as err:
            ActivityEnvironment().run(compute_rewards, judged)
        assert err.value.type == Failure.NODE_LOST and "stale placement" in err.value.message
        assert store.list(art.judge_prefix("r", 1) + "/") == [] and not store.exists(art.rewards_key("r", 1))
        # the current epoch writes both
        current = ActivityEnvironment().run(compute_rewards, judged.model_copy(update={"epoch": 2}))
    assert current.n == 2 and len(store.list(art.judge_prefix("r", 1) + "/")) == 2
    assert store.exists(art.rewards_key("r", 1))


def test_the_dataset_is_parsed_once_per_content_hash(
    step_inputs: tuple[str, DatasetInfo, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """compute_rewards keeps a split's parsed rows while their bytes hash to the DatasetInfo's
    sha256; a split with other content (another hash) is read again, so labels never go stale."""
    import activities.control as control

    uri, data, key = step_inputs
    parsed: list[str] = []
    monkeypatch.setattr(control, "load_jsonl", lambda path: parsed.append(str(path)) or load_jsonl(path))
    control._ROWS.clear()
    default = RewardSpec()  # the rule reward: the row's answer decides
    first = rewards(step_inputs, "", **default.model_dump(exclude_unset=True))
    again = rewards(step_inputs, "", **default.model_dump(exclude_unset=True))
    assert len(parsed) == 1 and again.reward_mean == first.reward_mean

    store = open_store(uri)
    rows = [json.loads(line) for line in store.get_bytes(data.key).decode().splitlines() if line.strip()]
    for answer, right in (("2", "s1-p0-g0"), ("3", "s1-p0-g1")):  # the samples answered "2" and "3"
        rows[0]["answer"] = answer
        content = ("\n".join(json.dumps(r) for r in rows) + "\n").encode()
        store.put_bytes(data.key, content)
        changed = DatasetInfo(key=data.key, n_rows=data.n_rows, sha256=hashlib.sha256(content).hexdigest())
        inp = RewardInput(run_id="r", step=1, store_uri=uri, chunk_keys=[key], dataset=changed, reward=default)
        got = ActivityEnvironment().run(compute_rewards, inp)
        scored = art.get_model(store, got.rewards_key, art.StepRewards).rewards
        assert max(scored, key=lambda r: r.reward).sample_id == right
    assert len(parsed) == 3
