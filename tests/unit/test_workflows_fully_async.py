"""``rollout.mode: fully_async`` (``rollout.max_staleness: K``): the schedule as plain
functions, and the real workflows on Temporal's time-skipping test server with stand-in
activities (tests/unit/workflow_harness.py). Step 1 samples its batch and fills a buffer
of K batches on v0; each later step trains the oldest and samples one more on the
weights the engines serve; every batch is stamped with the version that generated it,
lags the trained weights by at most K, starts where the one before stopped, and is
trained once. A re-placed step, a continue-as-new and a replay make the same schedule."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from spec.rollout import ONE_STEP_OFF_TIS_CAP
from spec.run import RunConfig
from tests.recorded_histories import record
from tests.unit.workflow_harness import (
    PROMPTS_PER_STEP, WAIT_S, Cluster, finish, lose_node_a, progress, rollout_section, run_config, scenario, start_run,
    step_of,
)
from workflows.contracts.placement import DatasetInfo
from workflows.contracts.sampling import Sampled
from workflows.contracts.step import RLStepInput
from workflows.failures import Failure, failure_in
from workflows.rollout_schedule import buffer_depth, check_batch, steps_ahead
from workflows.stubs import ROLLOUT, TRAIN_STEP, UPDATE_WEIGHTS
from workflows.training_run import RUN_WORKFLOWS, TrainingRun

STEPS = 5
P = PROMPTS_PER_STEP


def fully_async(k: int = 2, steps: int = STEPS, **overrides: object) -> RunConfig:
    return run_config(steps=steps, rollout=rollout_section(mode="fully_async", max_staleness=k), **overrides)


def batch(version: int, cursor: int) -> Sampled:
    return Sampled(chunk_keys=["k"], rewards_key="r", prompts=P, reward_mean=0.0, reward_std=0.0, accuracy=0.0,
                   reward_errors=0, response_len_mean=0.0, chunks_reused=0, engine_retries=0, phases={},
                   policy_version=version, data_cursor=cursor)


# ---- the schedule as functions --------------------------------------------------------------
def simulate(k: int, steps: int) -> list[tuple[int, int, int]]:
    """(step, generating version, buffer depth after the step) by the workflow's own rules."""
    buf: list[tuple[int, int]] = []  # (step it is for, version it was generated on)
    out = []
    for n in range(1, steps + 1):
        mine = buf.pop(0) if buf else (n, n - 1)
        assert mine[0] == n
        buf += [(m, n - 1) for m in steps_ahead(n, steps, len(buf), k)]
        out.append((n, mine[1], len(buf)))
    return out


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_schedule_fills_the_buffer_on_v0_then_tops_it_up_one_a_step(k: int) -> None:
    steps = 12
    got = simulate(k, steps)
    staleness = [(n - 1) - v for n, v, _ in got]
    assert all(0 <= s <= k for s in staleness)
    # step 1 on v0 (as sync), steps 2..K+1 sampled during step 1 (on v0), then exactly K behind
    assert staleness == [min(n - 1, k) for n in range(1, steps + 1)]
    assert [d for _, _, d in got] == [min(k, steps - n) for n in range(1, steps + 1)]


def test_steps_ahead_never_past_the_last_step_nor_the_depth() -> None:
    assert steps_ahead(1, 10, 0, 2) == [2, 3]
    assert steps_ahead(2, 10, 1, 2) == [4]
    assert steps_ahead(9, 10, 1, 2) == []
    assert steps_ahead(9, 10, 0, 2) == [10]
    assert steps_ahead(3, 10, 0, 0) == []  # sync
    assert steps_ahead(3, 10, 0, 1) == [4]  # one_step_off


def test_buffer_depth_by_mode() -> None:
    assert buffer_depth(run_config()) == 0
    assert buffer_depth(fully_async(k=3)) == 3
    assert buffer_depth(run_config(rollout={"mode": "one_step_off"})) == 1


def test_check_batch_refuses_a_wrong_cursor_or_too_stale_a_batch() -> None:
    inp = RLStepInput(run_id="r", step=5, config=fully_async(), train=fully_async().train, policy_version=4,
                      data_cursor=16, dataset=DatasetInfo(key="d", n_rows=64, sha256="0"), node_queue="q")
    assert check_batch(batch(2, 16), inp, 2) is None
    err = check_batch(batch(1, 16), inp, 2)
    assert err is not None and "staleness 3 is outside 0..2" in err.message and err.non_retryable
    err = check_batch(batch(3, 12), inp, 2)
    assert err is not None and "cursor 12" in err.message and "committed cursor is 16" in err.message
    assert check_batch(batch(5, 16), inp, 2) is not None  # generated on a version the step has not trained yet


def test_config_knobs() -> None:
    on = RunConfig.model_validate({"rollout": {"mode": "fully_async"}})
    assert on.rollout.max_staleness == 2 and on.train.tis_cap == ONE_STEP_OFF_TIS_CAP
    assert RunConfig.model_validate(on.model_dump()).rollout.max_staleness == 2  # a dump reads back
    assert RunConfig.model_validate({"rollout": {"mode": "fully_async"}, "train": {"tis_cap": None}}).train.tis_cap is None
    for mode in ("sync", "one_step_off"):
        with pytest.raises(ValidationError, match="max_staleness applies to mode fully_async") as err:
            RunConfig.model_validate({"rollout": {"mode": mode, "max_staleness": 3}})
        assert [e["loc"] for e in err.value.errors()] == [("rollout", "max_staleness")]
    with pytest.raises(ValidationError, match="max_staleness"):
        RunConfig.model_validate({"rollout": {"mode": "fully_async", "max_staleness": 0}})
    with pytest.raises(ValidationError, match="mode fully_async overlaps rollout with training"):
        RunConfig.model_validate({"mode": "sft", "sft": {"steps": 0}, "rollout": {"mode": "fully_async"}})


# ---- the workflows ---------------------------------------------------------------------------
def test_step_one_fills_the_buffer_during_its_train_step_on_v0() -> None:
    cluster = Cluster()
    gate = cluster.gate(TRAIN_STEP, 1)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, fully_async())
        await gate.wait_reached()

        async def buffered_two() -> None:  # train_step 1 is held: steps 2 and 3 are sampled beside it
            while not cluster.served(ROLLOUT, 3):
                await asyncio.sleep(0.05)
        await asyncio.wait_for(buffered_two(), WAIT_S)
        assert [(c.step, c.version) for c in cluster.served(ROLLOUT)] == [(1, 0), (2, 0), (3, 0)]
        assert [c.version for c in cluster.served(UPDATE_WEIGHTS)] == [0]  # v1 waits for train_step 1
        gate.release.set()
        await finish(handle)

    scenario(cluster, body)


def assert_k2_schedule(cluster: Cluster, steps: list) -> None:
    """What a fault-free K=2 run of STEPS steps did, whatever happened in between."""
    rollouts = [(i.step, i.policy_version, i.data_cursor) for i in cluster.rollout_inputs]
    assert sorted(set(rollouts)) == [(1, 0, 0), (2, 0, P), (3, 0, 2 * P), (4, 1, 3 * P), (5, 2, 4 * P)]
    trained = [(t.batch.step, t.batch.policy_version) for t in cluster.train_inputs]
    assert sorted(set(trained)) == [(n, n - 1) for n in range(1, STEPS + 1)]
    for t in cluster.train_inputs:  # each step trained its own step's batch
        assert {step_of(k) for k in t.batch.chunk_keys} == {t.batch.step}
    assert [s.rollout_version for s in steps] == [0, 0, 0, 1, 2]
    assert [s.staleness for s in steps] == [0, 1, 2, 2, 2]
    assert [s.buffer_depth for s in steps] == [2, 2, 2, 1, 0]
    assert [s.data_cursor for s in steps] == [n * P for n in range(1, STEPS + 1)]
    assert all(not s.next_buffer for s in steps)  # the state carries it, not the history


def test_fault_free_schedule_versions_staleness_depth_and_cursor() -> None:
    cluster = Cluster()

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, fully_async(), run_id="fa-run")
        summary = await finish(handle)
        assert (summary.steps, summary.policy_version, summary.data_cursor) == (STEPS, STEPS, STEPS * P)
        assert len(cluster.rollout_inputs) == STEPS  # no batch sampled twice
        assert len(cluster.train_inputs) == STEPS
        p = await progress(handle)
        assert_k2_schedule(cluster, p.steps)
        # steps 4 and 5 find the buffer already holding every remaining step's batch: nothing to overlap
        assert [s.overlap_seconds > 0 for s in p.steps] == [True, True, True, False, False]
        # the engines serve one version: v(n) is pushed after the batches sampled during step n
        order = [(c.name, c.step, c.version) for c in cluster.calls if c.name in (ROLLOUT.name, UPDATE_WEIGHTS.name)]
        for step, version in [(2, 0), (3, 0), (4, 1), (5, 2)]:
            assert order.index((ROLLOUT.name, step, version)) < order.index((UPDATE_WEIGHTS.name, None, version + 1)), order

        # the recorded histories replay on the same code: the schedule is in history, not re-raced
        replayer = Replayer(workflows=RUN_WORKFLOWS, data_converter=pydantic_data_converter)
        for wid in (handle.id, f"{handle.id}/step-1", f"{handle.id}/step-3"):
            await replayer.replay_workflow(await env.client.get_workflow_handle(wid).fetch_history())
        record("training_run_fully_async", await handle.fetch_history())
        record("rl_step_fully_async", await env.client.get_workflow_handle(f"{handle.id}/step-3").fetch_history())

    scenario(cluster, body)


def test_continue_as_new_carries_the_buffer() -> None:
    cluster = Cluster()

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, fully_async(steps_per_workflow_run=2))
        summary = await finish(handle)
        assert (summary.steps, summary.data_cursor) == (STEPS, STEPS * P)
        assert len(cluster.rollout_inputs) == STEPS  # the batches sampled ahead crossed the new execution
        assert_k2_schedule(cluster, (await progress(handle)).steps)

    scenario(cluster, body)


def test_lost_node_reruns_the_step_from_the_recorded_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node A stops while step 3 samples step 5's batch (on v2): step 3 is re-run on B from
    v2 with its own and step 4's batches from the run's state (never sampled again), and
    step 5's batch is sampled again on B at the same version, step and cursor (on a real
    node the stored chunks make that a reuse)."""

    async def check(cluster: Cluster, handle: WorkflowHandle) -> None:
        node_a, node_b = cluster.queues
        rollouts = [(c.queue, c.step, c.version) for c in cluster.served(ROLLOUT)]
        assert rollouts == [(node_a, 1, 0), (node_a, 2, 0), (node_a, 3, 0), (node_a, 4, 1), (node_a, 5, 2),
                            (node_b, 5, 2)]
        p = await progress(handle)
        assert_k2_schedule(cluster, p.steps)
        trained3 = {tuple(t.batch.chunk_keys) for t in cluster.train_inputs if t.batch.step == 3}
        assert len(trained3) == 1  # step 3 (tried on A, re-run on B): the same recorded batch

    lose_node_a(monkeypatch, fully_async(), (ROLLOUT, 5), (TRAIN_STEP, UPDATE_WEIGHTS), check)


def test_dynamic_sampling_composes_each_batch_drawing_where_the_last_stopped() -> None:
    """Rounds of a batch sampled ahead draw from the cursor the batch before it left, so a
    batch that needed two rounds moves every later batch's prompts (exactly once)."""
    cluster = Cluster()
    # step 2's first round keeps 1 of 4 groups: it draws a second round
    cluster.varied = lambda step, round_, groups: [0] if (step, round_) == (2, 0) else list(range(groups))
    rollout = rollout_section(mode="fully_async", max_staleness=2, dynamic_filter={"enabled": True})

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        summary = await finish(await start_run(env, run_config(steps=4, rollout=rollout)))
        assert [(i.step, i.round, i.policy_version, i.data_cursor) for i in cluster.rollout_inputs] == [
            (1, 0, 0, 0), (2, 0, 0, 4), (2, 1, 0, 8), (3, 0, 0, 12), (4, 0, 1, 16)]
        assert summary.data_cursor == 20
        assert [t.batch.step for t in cluster.train_inputs] == [1, 2, 3, 4]

    scenario(cluster, body)


def test_a_buffer_that_does_not_start_at_the_committed_cursor_fails_the_run() -> None:
    """A state whose buffer would skip prompts (here: a hand-built one) is refused by the
    step, naming the cursors, instead of training the wrong batch."""
    from workflows.run_state import RunState, RunSummary, TrainingRunInput
    from workflows.queues import CONTROL_QUEUE

    cluster = Cluster()
    cfg = fully_async()
    state = RunState(next_step=3, policy_version=2, data_cursor=2 * P, initialized=True,
                     dataset=DatasetInfo(key="runs/x/data/train.jsonl", n_rows=64, sha256="0" * 64), train=cfg.train,
                     buffer=[batch(1, 3 * P), batch(2, 4 * P)])

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await env.client.start_workflow(
            TrainingRun.run, TrainingRunInput(config=cfg, state=state), id="bad-buffer", task_queue=CONTROL_QUEUE,
            result_type=RunSummary,
        )
        with pytest.raises(WorkflowFailureError) as err:
            await finish(handle)
        kind, message = failure_in(err.value)
        assert kind == Failure.INVALID_INPUT and "committed cursor is 8" in message, message
        assert cluster.train_inputs == []

    scenario(cluster, body)


def test_a_fork_mid_buffer_takes_the_parents_batches_and_keeps_its_schedule() -> None:
    """``milestone fork`` at step 2 of a fully_async run: the fork's state carries the two
    batches the parent had sampled ahead (read from the parent's step-2 workflow), so the
    fork trains steps 3 and 4 on the parent's batches and samples only step 5's, on the
    version the parent did. A fork that changes the rollout samples afresh."""
    from milestone_cli.fork import parent_buffer, with_parent_buffer
    from spec.trainer_rpc import ForkPoint
    from workflows.run_state import RunState, RunSummary, TrainingRunInput
    from workflows.queues import CONTROL_QUEUE

    cluster = Cluster()
    cfg = fully_async()

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, cfg)
        await finish(handle)
        parent = TrainingRunInput(config=cfg)
        state = RunState(next_step=3, policy_version=2, data_cursor=2 * P, initialized=True,
                         dataset=DatasetInfo(key="runs/x/data/train.jsonl", n_rows=64, sha256="0" * 64), train=cfg.train)
        fork = TrainingRunInput(config=cfg, state=state, lineage=[ForkPoint(run_id=handle.id, step=2)])
        buffer, note = await parent_buffer(env.client, fork, parent)
        assert [(b.policy_version, b.data_cursor) for b in buffer] == [(0, 2 * P), (1, 3 * P)]
        assert [{step_of(k) for k in b.chunk_keys} for b in buffer] == [{3}, {4}]
        assert note == f"carries 2 batch(es) {handle.id} sampled ahead after step 2"
        # fewer steps left than batches: only the ones the fork will train
        short = fork.model_copy(update={"config": fully_async(steps=3)})
        assert len((await parent_buffer(env.client, short, TrainingRunInput(config=short.config)))[0]) == 1
        changed = fork.model_copy(update={"config": fully_async(k=3)})
        assert (await parent_buffer(env.client, changed, parent))[0] == []

        fork, _ = await with_parent_buffer(env.client, fork, parent)
        cluster.rollout_inputs.clear()
        cluster.train_inputs.clear()
        fork_handle = await env.client.start_workflow(
            TrainingRun.run, fork, id="fork-mid-buffer", task_queue=CONTROL_QUEUE, result_type=RunSummary)
        summary = await finish(fork_handle)
        assert (summary.steps, summary.data_cursor) == (STEPS, STEPS * P)
        assert [(i.step, i.policy_version, i.data_cursor) for i in cluster.rollout_inputs] == [(5, 2, 4 * P)]
        assert [(t.batch.step, {step_of(k) for k in t.batch.chunk_keys}) for t in cluster.train_inputs] == [
            (3, {3}), (4, {4}), (5, {5})]
        assert [s.rollout_version for s in (await progress(fork_handle)).steps] == [0, 1, 2]  # as the parent's

    scenario(cluster, body)
