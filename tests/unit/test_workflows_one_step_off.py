"""``rollout.mode: one_step_off`` on Temporal's time-skipping test server (stand-in
activities, tests/unit/workflow_harness.py): step n+1's batch is sampled during step n's
train_step on the weights step n sampled with, the weight push waits for it, the
schedule is fixed (so a retry or a re-placement replays it, never re-races it), and each
batch is trained exactly once."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.recorded_histories import record
from tests.unit.workflow_harness import (
    PROMPTS_PER_STEP, WAIT_S, Cluster, finish, lose_node_a, progress, rollout_section, run_config, scenario, start_run,
    step_of,
)
from spec.run import RunConfig
from workflows.stubs import ROLLOUT, TRAIN_STEP, UPDATE_WEIGHTS

STEPS = 4


def one_step_off(**overrides: object) -> RunConfig:
    return run_config(steps=STEPS, rollout=rollout_section(mode="one_step_off"), **overrides)


def test_next_rollout_runs_during_train_step_one_version_behind() -> None:
    cluster = Cluster()
    gate = cluster.gate(TRAIN_STEP, 2)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, one_step_off(), run_id="osf-run")
        await gate.wait_reached()
        # train_step 2 is held: step 3's rollout still runs, on the weights step 2 sampled with (v0)
        async def step3_sampled() -> None:
            while not cluster.served(ROLLOUT, 3):
                await asyncio.sleep(0.05)
        await asyncio.wait_for(step3_sampled(), WAIT_S)
        assert [c.version for c in cluster.served(UPDATE_WEIGHTS)] == [0, 1]  # v2 waits for train_step 2
        gate.release.set()
        summary = await finish(handle)
        assert (summary.steps, summary.policy_version, summary.data_cursor) == (STEPS, STEPS, STEPS * PROMPTS_PER_STEP)
        # step 1 samples on v0 as in sync; then each step's batch is one version behind
        assert [(i.step, i.policy_version) for i in cluster.rollout_inputs] == [(1, 0), (2, 0), (3, 1), (4, 2)]
        assert [i.data_cursor for i in cluster.rollout_inputs] == [n * PROMPTS_PER_STEP for n in range(STEPS)]
        # each train step trained its own step's batch, once, from the version before it
        assert [(t.batch.step, t.batch.policy_version) for t in cluster.train_inputs] == [(n, n - 1) for n in range(1, STEPS + 1)]
        assert [{step_of(k) for k in t.batch.chunk_keys} for t in cluster.train_inputs] == [{n} for n in range(1, STEPS + 1)]
        assert len(cluster.served(ROLLOUT)) == STEPS  # no batch sampled twice
        # the push of v(n) comes after step n+1's rollout (the engines serve one version at a time)
        order = [(c.name, c.step, c.version) for c in cluster.calls if c.name in (ROLLOUT.name, UPDATE_WEIGHTS.name)]
        for n in range(1, STEPS):
            assert order.index((ROLLOUT.name, n + 1, n - 1)) < order.index((UPDATE_WEIGHTS.name, None, n)), order
        p = await progress(handle)
        assert [s.rollout_version for s in p.steps] == [0, 0, 1, 2]
        assert all(not s.next_buffer for s in p.steps)  # the state carries the batch, not the history
        record("training_run_one_step_off", await handle.fetch_history())
        record("rl_step_one_step_off", await env.client.get_workflow_handle(f"{handle.id}/step-2").fetch_history())

    scenario(cluster, body)


def test_sync_mode_samples_each_step_on_the_previous_version() -> None:
    cluster = Cluster()

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=3))
        await finish(handle)
        assert [(i.step, i.policy_version) for i in cluster.rollout_inputs] == [(1, 0), (2, 1), (3, 2)]
        assert [s.rollout_version for s in (await progress(handle)).steps] == [0, 1, 2]

    scenario(cluster, body)


def test_lost_node_reruns_the_step_with_its_prefetched_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node A stops during step 3's train_step (step 3's batch was sampled during step 2,
    step 4's is being sampled): the step is re-run on B from v2 with the batch already
    recorded, and step 4's batch is sampled again on B at the same version with the same
    inputs (the stored chunks make that a reuse on a real node)."""

    async def check(cluster: Cluster, handle: WorkflowHandle) -> None:
        node_a, node_b = cluster.queues
        rollouts = [(c.queue, c.step, c.version) for c in cluster.served(ROLLOUT)]
        assert rollouts[:4] == [(node_a, 1, 0), (node_a, 2, 0), (node_a, 3, 1), (node_a, 4, 2)]
        assert (node_b, 3, 1) not in rollouts  # step 3's batch was recorded: not sampled again
        assert rollouts[4:] == [(node_b, 4, 2)]
        trained = [(t.batch.step, t.batch.policy_version, tuple(t.batch.chunk_keys)) for t in cluster.train_inputs]
        assert [(s, v) for s, v, _ in trained if s != 3] == [(1, 0), (2, 1), (4, 3)]
        assert len({k for s, _, k in trained if s == 3}) == 1  # step 3 (tried on A, re-run on B): the same batch
        p = await progress(handle)
        assert [s.rollout_version for s in p.steps] == [0, 0, 1, 2]

    lose_node_a(monkeypatch, one_step_off(), (ROLLOUT, 4), (TRAIN_STEP, UPDATE_WEIGHTS), check)


def test_one_step_off_turns_truncated_is_on_unless_the_config_sets_tis_cap() -> None:
    from spec.rollout import ONE_STEP_OFF_TIS_CAP

    on = RunConfig.model_validate({"rollout": {"mode": "one_step_off"}})
    assert on.train.tis_cap == ONE_STEP_OFF_TIS_CAP
    # stored and read back (a continue-as-new, a fork): the default is kept as if set
    assert RunConfig.model_validate(on.model_dump(exclude_unset=True)).train.tis_cap == ONE_STEP_OFF_TIS_CAP
    assert RunConfig.model_validate({"rollout": {"mode": "one_step_off"}, "train": {"tis_cap": None}}).train.tis_cap is None
    assert RunConfig.model_validate({}).train.tis_cap is None  # sync: off by default
