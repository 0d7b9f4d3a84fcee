"""The reward activity (``compute_rewards_on_node``, the node agent's) on a real local store,
run in Temporal's activity test environment on a node runtime that starts nothing: a reward
function that cannot be loaded fails the run (InvalidInput, not retried); one that raises when
called fails it too (RewardError, not retried) or scores 0 (error_policy zero); an endpoint that
is down is a retried RewardError; group statistics; writes at the step's placement epoch. The
chunks are read from the store (the node does not hold them: no rollout ran there)."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.control import prepare_data
from activities.node import NodeActivities
from gpu_runtime.node.runtime import NodeRuntime
from gpu_runtime.proc.processes import free_port
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.uri import open_store
from spec.data import DataSpec
from spec.reward import RewardSpec
from tests.engine_fixtures import _tokenizer
from tests.unit.test_control_activities import stored_rows
from workflows.contracts.placement import DatasetInfo, PrepareDataInput
from workflows.contracts.sampling import RewardInput, RewardResult
from workflows.failures import Failure

FNS = "tests.reward_fns"  # light functions the reward process loads by dotted path


@pytest.fixture
def node(tmp_path: Path) -> NodeActivities:
    return NodeActivities(NodeRuntime("node0", "boot", tmp_path / "node"))


def compute_rewards(node: NodeActivities, inp: RewardInput) -> RewardResult:
    return ActivityEnvironment().run(node.rollout.compute_rewards_on_node, inp)


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
    return compute_rewards(NodeActivities(NodeRuntime("node0", "boot", Path(uri.removeprefix("file://")).parent
                                                      / "node")), inp)


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


def test_group_stats_are_reported_when_asked(step_inputs: tuple[str, DatasetInfo, str], node: NodeActivities) -> None:
    uri, data, key = step_inputs
    store = open_store(uri)
    chunk = art.get_model(store, key, art.RolloutChunk)
    right = stored_rows(Path(uri.removeprefix("file://")).parent, data.key)[0]["answer"].rpartition("#### ")[2]
    chunk.samples[0] = chunk.samples[0].model_copy(update={"response_text": right})
    art.put_model(store, key, chunk)
    inp = RewardInput(run_id="r", step=1, store_uri=uri, chunk_keys=[key], dataset=data, reward=RewardSpec(),
                      round=2, group_size=2)
    result = compute_rewards(node, inp)
    assert result.rewards_key == art.rewards_key("r", 1, 2) == "runs/r/steps/000001/round-02/rewards.json"
    assert (result.groups, result.varied_groups) == (1, [0])  # the first is right, "3" is wrong
    single = compute_rewards(node, inp.model_copy(update={"group_size": 1}))
    assert (single.groups, single.varied_groups, single.groups_all_correct, single.groups_all_wrong) == (2, [], 1, 1)


# ---- fencing: every write at the step's placement epoch --------------------------------------
def test_rewards_and_judge_records_of_a_left_behind_placement_are_refused(
    step_inputs: tuple[str, DatasetInfo, str], node: NodeActivities,
) -> None:
    """Once the run has moved to a newer placement epoch, the reward activity of the old one
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
        compute_rewards(node, stale)
    assert err.value.type == Failure.NODE_LOST and "stale placement" in err.value.message
    assert not store.exists(art.rewards_key("r", 1))
    with reward_server() as server:
        judged = stale.model_copy(update={"reward": RewardSpec(kind="judge", url=server.url, max_retries=0)})
        with pytest.raises(ApplicationError) as err:
            compute_rewards(node, judged)
        assert err.value.type == Failure.NODE_LOST and "stale placement" in err.value.message
        assert store.list(art.judge_prefix("r", 1) + "/") == [] and not store.exists(art.rewards_key("r", 1))
        # the current epoch writes both
        current = compute_rewards(node, judged.model_copy(update={"epoch": 2}))
    assert current.n == 2 and len(store.list(art.judge_prefix("r", 1) + "/")) == 2
    assert store.exists(art.rewards_key("r", 1))
