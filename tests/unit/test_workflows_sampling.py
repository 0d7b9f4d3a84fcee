"""Dynamic sampling (``rollout.dynamic_filter``) in ``RLStep``: the decision logic as
plain functions, and the real workflows on Temporal's time-skipping test server with
stand-in activities (tests/unit/workflow_harness.py) that say which groups vary."""

from __future__ import annotations

import math

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from tests.unit.workflow_harness import (
    Cluster, finish, group_mean, progress, rollout_section, run_config, scenario, start_run,
)
from spec.events import DynamicFilterEmpty
from workflows.contracts.sampling import RewardResult
from workflows.failures import Failure, failure_in
from workflows.sampling import choose_groups, more_rounds, pooled, trained_reward_mean
from workflows.stubs import COMPUTE_REWARDS_ON_NODE, ROLLOUT, TRAIN_STEP
from workflows.training_run import RUN_WORKFLOWS

GROUP = 2  # the group size of rollout_section


def filtered(**dynamic: object) -> dict:
    """The harness config with dynamic sampling: 4 prompts per step, groups of 2, 6 prompts a round."""
    return rollout_section(oversample=1.5, dynamic_filter={"enabled": True, **dynamic})


# ---- the decision logic ---------------------------------------------------------------------
def test_more_rounds_until_enough_kept_or_max_rounds() -> None:
    assert more_rounds(kept=0, target=4, rounds_done=0, max_rounds=3)
    assert more_rounds(kept=3, target=4, rounds_done=2, max_rounds=3)
    assert not more_rounds(kept=4, target=4, rounds_done=1, max_rounds=3)
    assert not more_rounds(kept=9, target=4, rounds_done=1, max_rounds=3)
    assert not more_rounds(kept=3, target=4, rounds_done=3, max_rounds=3)


def test_choose_groups_in_round_order_up_to_the_target() -> None:
    assert choose_groups([[0, 2], [1, 3, 5]], 4, 6) == ([(0, 0), (0, 2), (1, 1), (1, 3)], False)
    assert choose_groups([[1], [], [4]], 4, 6) == ([(0, 1), (2, 4)], False)  # a shortfall: what was kept
    assert choose_groups([[], []], 4, 6) == ([(0, 0), (0, 1), (0, 2), (0, 3)], True)  # none: round 0 as it was
    assert choose_groups([[]], 4, 3) == ([(0, 0), (0, 1), (0, 2)], True)


def test_pooled_reward_statistics() -> None:
    a = RewardResult(rewards_key="a", reward_mean=1.0, reward_std=0.0, accuracy=1.0, n=4, seconds=0)
    b = RewardResult(rewards_key="b", reward_mean=0.0, reward_std=0.0, accuracy=0.0, n=4, seconds=0)
    mean, std, acc = pooled([a, b])
    assert (mean, acc) == (0.5, 0.5) and math.isclose(std, 0.5)  # eight samples: four 1s, four 0s
    c = RewardResult(rewards_key="c", reward_mean=2.0, reward_std=1.0, accuracy=0.25, n=2, seconds=0)
    mean, std, acc = pooled([c])
    assert (mean, std, acc) == (2.0, 1.0, 0.25)
    assert pooled([]) == (0.0, 0.0, 0.0)


def test_the_trained_reward_mean_is_the_mean_of_the_kept_groups_means() -> None:
    def rw(means: list[float]) -> RewardResult:
        return RewardResult(rewards_key="k", reward_mean=0, reward_std=0, accuracy=0, n=2 * len(means), seconds=0,
                            groups=len(means), group_means=means)

    assert trained_reward_mean([rw([0.0, 0.5, 1.0]), rw([0.25, 0.75])], [(0, 1), (1, 0), (1, 1)]) == 0.5
    assert trained_reward_mean([rw([1.0])], []) == 0.0


def test_config_rules() -> None:
    assert run_config(rollout=filtered()).rollout.prompts_per_round == 6
    with pytest.raises(ValueError, match="dynamic_filter.enabled needs group_size >= 2"):
        run_config(rollout={**filtered(), "group_size": 1})
    with pytest.raises(ValueError, match="oversample applies with dynamic_filter.enabled only"):
        run_config(rollout={"oversample": 2.0})
    with pytest.raises(ValueError, match="max_rounds"):
        run_config(rollout=filtered(max_rounds=0))


# ---- on the test server ---------------------------------------------------------------------
def varied_0_2_then_odd(step: int, round_: int, groups: int) -> list[int]:
    """Round 0 keeps groups 0 and 2, round 1 the odd ones: 5 kept after two rounds."""
    return [0, 2] if round_ == 0 else [g for g in range(groups) if g % 2]


def test_rounds_until_enough_groups_vary_then_the_kept_groups_train() -> None:
    cluster = Cluster()
    cluster.varied = varied_0_2_then_odd

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=3, rollout=filtered()))
        summary = await finish(handle)
        # every step drew two rounds of 6 prompts: the cursor moved past all 12 (filtered ones count as used)
        assert (summary.steps, summary.data_cursor) == (3, 36)
        step1 = [i for i in cluster.rollout_inputs if i.step == 1]
        assert [(i.round, i.data_cursor, i.n_prompts) for i in step1] == [(0, 0, 6), (1, 6, 6)]
        assert [(i.round, i.group_size) for i in cluster.reward_inputs if i.step == 1] == [(0, GROUP), (1, GROUP)]
        # scored on the node that generated the samples; nothing assembled: the trainer gets the selection
        assert {c.queue for c in cluster.served(COMPUTE_REWARDS_ON_NODE)} == {cluster.queues[0]}
        train = cluster.train_inputs[0]
        assert (train.batch.step, train.batch.chunk_keys, train.batch.rewards_key) == (1, [], "")
        assert train.batch.selection is not None and train.batch.selection.groups == [(0, 0), (0, 2), (1, 1), (1, 3)]
        rounds = train.batch.selection.rounds
        assert [r.rewards_key.rpartition("/steps/1/")[2] for r in rounds] == ["r0/rewards.json", "r1/rewards.json"]
        assert all(k.startswith("runs/") and "/r1/" in k for k in rounds[1].chunk_keys)
        assert train.sampling is not None and train.sampling.groups_trained == 4  # exported by the node
        assert [c.data_cursor for c in cluster.checkpoint_inputs] == [24, 36]  # checkpoints at steps 2 and 3
        p = await progress(handle)
        s = p.steps[0].sampling
        assert s is not None
        assert (s.rounds, s.prompts_drawn, s.groups_generated, s.groups_kept, s.groups_trained) == (2, 12, 12, 5, 4)
        # filtered: round 0 groups 1, 3, 4, 5 and round 1 groups 0, 2, 4 (the stand-in calls even ones all correct)
        assert (s.groups_filtered_all_correct, s.groups_filtered_all_wrong, s.fallback) == (4, 3, False)
        # the trained groups' mean reward, from the rounds' per-group means
        assert s.trained_reward_mean == sum(group_mean(r, g) for r, g in [(0, 0), (0, 2), (1, 1), (1, 3)]) / 4
        assert [st.data_cursor for st in p.steps] == [12, 24, 36]
        assert set(p.steps[0].phase_seconds) >= {"rollout", "reward", "train"}
        assert "assemble" not in p.steps[0].phase_seconds

    scenario(cluster, body)


def test_enough_in_the_first_round_draws_no_second() -> None:
    cluster = Cluster()

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        summary = await finish(await start_run(env, run_config(steps=2, rollout=filtered())))
        assert summary.data_cursor == 12  # 6 prompts a step
        assert [(i.step, i.round) for i in cluster.rollout_inputs] == [(1, 0), (2, 0)]
        assert [t.batch.selection.groups for t in cluster.train_inputs if t.batch.selection] == [[(0, 0), (0, 1), (0, 2), (0, 3)]] * 2

    scenario(cluster, body)


def test_shortfall_trains_on_what_was_kept_or_the_first_round_when_nothing() -> None:
    cluster = Cluster()
    # step 1: one group varies per round (3 kept after max_rounds 3); step 2: none ever
    cluster.varied = lambda step, round_, groups: [round_] if step == 1 else []

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=2, rollout=filtered(max_rounds=3)))
        summary = await finish(handle)
        assert summary.data_cursor == 2 * 3 * 6
        assert [t.batch.selection.groups for t in cluster.train_inputs if t.batch.selection] == [[(0, 0), (1, 1), (2, 2)],
                                                                                    [(0, 0), (0, 1), (0, 2), (0, 3)]]
        p = await progress(handle)
        assert [(s.sampling.groups_kept, s.sampling.groups_trained, s.sampling.fallback)
                for s in p.steps if s.sampling] == [(3, 3, False), (0, 4, True)]
        assert [(e.step, e.rounds, e.groups_trained) for e in p.events if isinstance(e, DynamicFilterEmpty)] == [
            (2, 3, 4)]

    scenario(cluster, body)


def test_shortfall_fails_the_run_under_on_shortfall_fail() -> None:
    cluster = Cluster()
    cluster.varied = lambda step, round_, groups: [0] if step == 2 else list(range(groups))

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=3, rollout=filtered(max_rounds=2, on_shortfall="fail")))
        with pytest.raises(WorkflowFailureError) as err:
            await finish(handle)
        kind, message = failure_in(err.value)
        assert kind == Failure.SAMPLING_SHORTFALL
        assert message.startswith("step 2: dynamic sampling kept 2 of 4 groups after 2 rounds of 6 prompts")
        assert [t.batch.step for t in cluster.train_inputs] == [1]  # step 2 never trained
        assert len([i for i in cluster.rollout_inputs if i.step == 2]) == 2

    scenario(cluster, body)


def test_a_retried_round_decides_the_same_and_the_history_replays() -> None:
    """Round 1's reward activity fails once: it is retried, the rounds and the chosen groups are
    those of a run without the fault, no round is generated twice, and the step's recorded
    history replays against the workflow code."""
    cluster = Cluster()
    cluster.varied = varied_0_2_then_odd

    async def flaky(queue: str, attempt: int) -> None:
        if attempt == 1 and cluster.reward_inputs[-1].round == 1:
            raise ApplicationError("judge endpoint down", type=Failure.REWARD_ERROR.value)

    cluster.hook(COMPUTE_REWARDS_ON_NODE, 1, flaky)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=1, rollout=filtered()))
        await finish(handle)
        served = cluster.served(COMPUTE_REWARDS_ON_NODE, 1)
        assert [(c.attempt, i.round) for c, i in zip(served, cluster.reward_inputs)] == [(1, 0), (1, 1), (2, 1)]
        assert [i.round for i in cluster.rollout_inputs] == [0, 1]
        assert cluster.train_inputs[0].batch.selection.groups == [(0, 0), (0, 2), (1, 1), (1, 3)]
        history = await env.client.get_workflow_handle(f"{handle.id}/step-1").fetch_history()
        scheduled = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                     if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]
        assert scheduled[:5] == [ROLLOUT.name, COMPUTE_REWARDS_ON_NODE.name, ROLLOUT.name, COMPUTE_REWARDS_ON_NODE.name,
                                 TRAIN_STEP.name]
        replayer = Replayer(workflows=RUN_WORKFLOWS, data_converter=pydantic_data_converter)
        await replayer.replay_workflow(history)

    scenario(cluster, body)


def test_without_the_filter_the_step_is_unchanged() -> None:
    cluster = Cluster()

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=1))
        await finish(handle)
        assert [(i.round, i.n_prompts, i.data_cursor) for i in cluster.rollout_inputs] == [(0, None, 0)]
        assert [i.group_size for i in cluster.reward_inputs] == [0]
        (train,) = cluster.train_inputs  # the rollout's chunks and their rewards, as they are
        assert train.batch.selection is None and train.batch.chunk_keys == cluster.reward_inputs[0].chunk_keys
        assert train.batch.rewards_key == "runs/" + train.run_id + "/steps/1/r0/rewards.json"
        p = await progress(handle)
        assert p.steps[0].sampling is None and p.steps[0].data_cursor == 4

    scenario(cluster, body)


def test_one_step_off_samples_the_next_step_with_its_rounds_one_version_behind() -> None:
    """Dynamic sampling inside the overlapped half: step n+1's rounds draw from the cursor
    step n leaves and run on the weights step n sampled with."""
    cluster = Cluster()
    cluster.varied = lambda step, round_, groups: [0, 1, 2] if round_ == 0 else list(range(groups))

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        summary = await finish(await start_run(env, run_config(steps=3, rollout={**filtered(), "mode": "one_step_off"})))
        assert summary.data_cursor == 3 * 2 * 6  # two rounds of 6 prompts every step
        assert [(i.step, i.round, i.policy_version, i.data_cursor) for i in cluster.rollout_inputs] == [
            (1, 0, 0, 0), (1, 1, 0, 6), (2, 0, 0, 12), (2, 1, 0, 18), (3, 0, 1, 24), (3, 1, 1, 30)]
        assert [t.batch.step for t in cluster.train_inputs] == [1, 2, 3]

    scenario(cluster, body)
