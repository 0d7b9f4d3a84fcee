"""``TrainingRun`` and ``RLStep`` on Temporal's time-skipping test server.

The real workflows run on a real worker; the activities are stand-ins under the
real names (tests/unit/workflow_harness.py). Each test drives one control path
of DESIGN §4-7: activity retry, node loss and re-placement, pause / resume,
``set_hparams``, continue-as-new, and resuming after a divergence.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from spec.engine import EngineUpdate
from spec.events import Divergence, EnginesSet, HParamsSet, NodeClaimed, NodeLost
from spec.train import HParamUpdate
from tests.unit.workflow_harness import (
    PROMPTS_PER_STEP, Cluster, finish, lose_node_a, progress, reward_of, run_config, scenario, start_run, wait_progress,
)
from workflows.contracts.step import StepSummary
from workflows.failures import Failure, failure
from workflows.stubs import CLAIM_NODE, INIT_POLICY, PREPARE_DATA, ROLLOUT, TRAIN_STEP
from workflows.training_run import TrainingRun


def assert_committed_once(cluster: Cluster, steps: int, summary_steps: list[StepSummary]) -> None:
    """Each step committed once, in order: version +1 and cursor +prompts per step."""
    assert [s.step for s in summary_steps] == list(range(1, steps + 1))
    assert [s.policy_version for s in summary_steps] == list(range(1, steps + 1))
    assert [s.data_cursor for s in summary_steps] == [PROMPTS_PER_STEP * n for n in range(1, steps + 1)]
    # the trainer took one successful step per RL step, each from the version before it
    assert [(t.batch.step, t.batch.policy_version) for t in cluster.train_inputs] == [(n, n - 1) for n in range(1, steps + 1)]


async def assert_replaced(handle: WorkflowHandle, cluster: Cluster, node_a: str, node_b: str, lost_at_step: int) -> None:
    """Node A served until ``lost_at_step``; B was claimed (A excluded), brought to the
    committed version, and ran the lost step and the rest; each step committed once."""
    # train steps A served before the loss, then all of them on B (A's failed call aside)
    trained = [(c.queue, c.step) for c in cluster.served(TRAIN_STEP) if c.queue == node_b or c.step < lost_at_step]
    assert trained == [(node_a, n) for n in range(1, lost_at_step)] + [(node_b, n) for n in range(lost_at_step, 4)]
    assert [(q, i.policy_version) for q, i in cluster.init_inputs] == [(node_a, 0), (node_b, lost_at_step - 1)]
    # each placement has its epoch, and every step's node work carries the epoch it ran under
    assert [i.setup.epoch for _, i in cluster.init_inputs] == [1, 2]
    assert [t.epoch for t in cluster.train_inputs] == [1] * (lost_at_step - 1) + [2] * (4 - lost_at_step)
    assert len(cluster.served(CLAIM_NODE)) == 2
    p = await progress(handle)
    assert p.state == "completed" and p.node_queue == node_b
    assert [e.queue for e in p.events if isinstance(e, NodeClaimed)] == [node_a, node_b]
    lost = [(e.queue, e.step) for e in p.events if isinstance(e, NodeLost)]
    assert lost == [(node_a, lost_at_step)]
    assert_committed_once(cluster, 3, p.steps)


def test_train_step_retried_then_used_once() -> None:
    cluster = Cluster()

    async def flaky(queue: str, attempt: int) -> None:
        if attempt == 1:
            raise ApplicationError("trainer process exited", type=Failure.TRAINER_DIED.value)

    cluster.hook(TRAIN_STEP, 2, flaky)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=3))
        summary = await finish(handle)
        assert [c.attempt for c in cluster.served(TRAIN_STEP, 2)] == [1, 2]
        assert len(cluster.served(ROLLOUT, 2)) == 1  # the retry stays inside the activity
        assert (summary.steps, summary.policy_version, summary.data_cursor) == (3, 3, 3 * PROMPTS_PER_STEP)
        p = await progress(handle)
        assert p.state == "completed"
        assert_committed_once(cluster, 3, p.steps)

    scenario(cluster, body)


def test_lost_node_is_replaced_and_the_step_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node A's worker stops right after step 2's rollout: its train_step waits on a
    queue nobody polls, schedule-to-start times out, RLStep fails with NodeLost, and
    the run re-places itself on node B at the committed version and re-runs step 2
    (the timeout runs on the wall clock: ``lose_node_a``)."""

    async def check(cluster: Cluster, handle: WorkflowHandle) -> None:
        node_a, node_b = cluster.queues
        # A ran step 1 and step 2's rollout; step 2 was re-run whole on B, from v1
        assert [(c.queue, c.step) for c in cluster.served(ROLLOUT)] == [
            (node_a, 1), (node_a, 2), (node_b, 2), (node_b, 3)
        ]
        await assert_replaced(handle, cluster, node_a, node_b, lost_at_step=2)

    lose_node_a(monkeypatch, run_config(steps=3), (ROLLOUT, 2), (TRAIN_STEP,), check)


def test_node_lost_raised_by_activity_is_replaced() -> None:
    """A node agent that no longer knows the run (restarted in place) raises NodeLost
    itself (activities/node.py ``_setup``); the run re-places the same way."""
    cluster = Cluster(n_nodes=2)
    node_a, node_b = cluster.queues

    async def no_setup(queue: str, attempt: int) -> None:
        if queue == node_a:
            raise failure(Failure.NODE_LOST, "node has no setup for run")

    cluster.hook(TRAIN_STEP, 2, no_setup)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=3))
        summary = await finish(handle)
        assert (summary.steps, summary.policy_version, summary.data_cursor) == (3, 3, 3 * PROMPTS_PER_STEP)
        assert [c.attempt for c in cluster.served(TRAIN_STEP, 2)] == [1, 1]  # non-retryable on A, then B
        await assert_replaced(handle, cluster, node_a, node_b, lost_at_step=2)

    scenario(cluster, body)


def test_node_lost_during_placement_claims_another() -> None:
    """``init_policy`` itself reports NodeLost while the run is placed: the run claims
    another node instead of failing."""
    cluster = Cluster(n_nodes=2)
    node_a, node_b = cluster.queues

    async def lost(queue: str, attempt: int) -> None:
        if queue == node_a:
            raise failure(Failure.NODE_LOST, "node lost its setup during init")

    cluster.hook(INIT_POLICY, None, lost)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=2))
        summary = await finish(handle)
        assert (summary.steps, summary.policy_version) == (2, 2)
        assert [c.queue for c in cluster.served(INIT_POLICY)] == [node_a, node_b]
        assert [c.queue for c in cluster.served(TRAIN_STEP)] == [node_b, node_b]
        p = await progress(handle)
        lost = [(e.queue, e.step, e.message) for e in p.events if isinstance(e, NodeLost)]
        assert p.node_queue == node_b and lost == [(node_a, None, "node lost its setup during init")]

    scenario(cluster, body)


def test_paused_run_waits_for_resume() -> None:
    cluster = Cluster()
    held = cluster.gate(TRAIN_STEP, 1)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        # no liveness watch: the test server does not skip time while an activity runs,
        # and the watch runs through the pause (the hour below would pass on the wall clock)
        handle = await start_run(env, run_config(steps=3, node={"liveness_timeout_s": 0}))
        await held.wait_reached()
        await handle.signal(TrainingRun.pause)
        await wait_progress(handle, lambda p: p.state == "paused", "the pause signal")
        held.release.set()  # step 1 commits; step 2 must not start
        p = await wait_progress(handle, lambda p: p.step == 1, "step 1 to commit")
        assert p.state == "paused"
        await env.sleep(timedelta(hours=1))  # an hour of skipped time changes nothing
        p = await progress(handle)
        assert (p.state, p.step, p.policy_version) == ("paused", 1, 1)
        assert not cluster.served(ROLLOUT, 2)

        await handle.signal(TrainingRun.resume)
        summary = await finish(handle)
        assert summary.steps == 3
        assert_committed_once(cluster, 3, (await progress(handle)).steps)

    scenario(cluster, body)


def test_set_hparams_accepted_applies_to_next_step() -> None:
    cluster = Cluster()
    held = cluster.gate(TRAIN_STEP, 1)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=3))
        await held.wait_reached()
        train = await handle.execute_update(TrainingRun.set_hparams, HParamUpdate(lr=1e-3, clip_eps=0.1))
        assert train["lr"] == 1e-3 and train["clip_eps"] == 0.1
        held.release.set()
        await finish(handle)
        # step 1 was already sent with the old values; every later step carries the new ones
        assert [(t.batch.step, t.batch.hparams.lr, t.batch.hparams.clip_eps) for t in cluster.train_inputs] == [
            (1, 1e-4, 0.2), (2, 1e-3, 0.1), (3, 1e-3, 0.1)
        ]
        events = [e.values for e in (await progress(handle)).events if isinstance(e, HParamsSet)]
        assert events == [{"lr": 0.001, "clip_eps": 0.1}]

    scenario(cluster, body)


def test_set_hparams_null_turns_an_optional_knob_off_from_the_next_step() -> None:
    cluster = Cluster()
    held = cluster.gate(TRAIN_STEP, 1)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=2, train={"lr": 1e-4, "tis_cap": 2.0}))
        await held.wait_reached()
        train = await handle.execute_update(TrainingRun.set_hparams, HParamUpdate(unset=["tis_cap"]))
        assert train["tis_cap"] is None and train["lr"] == 1e-4
        held.release.set()
        await finish(handle)
        assert [(t.batch.step, t.batch.hparams.tis_cap) for t in cluster.train_inputs] == [(1, 2.0), (2, None)]
        events = [e.values for e in (await progress(handle)).events if isinstance(e, HParamsSet)]
        assert events == [{"tis_cap": None}]

    scenario(cluster, body)


def test_set_engines_resizes_the_fleet_from_the_next_step() -> None:
    """``milestone set engines.num_engines=3``: step 1 (already sent) keeps 2 engines, every
    later step's weight update asks the node for 3; the change is an event and in history."""
    cluster = Cluster()
    held = cluster.gate(TRAIN_STEP, 1)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        cfg = run_config(steps=3)
        assert cfg.engines.num_engines == 2
        handle = await start_run(env, cfg)
        await held.wait_reached()
        assert await handle.execute_update(TrainingRun.set_engines, EngineUpdate(num_engines=3)) == {"num_engines": 3}
        held.release.set()
        await finish(handle)
        assert [n for _, n in cluster.engine_counts] == [2, 2, 3, 3]  # v0 and step 1, then steps 2 and 3
        p = await progress(handle)
        assert len(p.engines) == 3
        assert [(e.before, e.after) for e in p.events if isinstance(e, EnginesSet)] == [(2, 3)]

    scenario(cluster, body)


@pytest.mark.parametrize(
    ("update", "message"),
    [(HParamUpdate(), "no field given"), (HParamUpdate(kl_coef=0.05), "kl_coef"),
     (HParamUpdate(betas=(0.9, 1.5)), "betas[1] must be in [0, 1)")],
    ids=["no-fields", "kl-coef-without-reference", "merged-section-invalid"],
)
def test_set_hparams_rejected_leaves_run_unaffected(update: HParamUpdate, message: str) -> None:
    cluster = Cluster()
    held = cluster.gate(TRAIN_STEP, 1)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        cfg = run_config(steps=2)
        assert cfg.train.kl_coef == 0
        handle = await start_run(env, cfg)
        await held.wait_reached()
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await handle.execute_update(TrainingRun.set_hparams, update)
        assert message in str(err.value.cause)
        held.release.set()
        summary = await finish(handle)
        assert summary.steps == 2
        assert [t.batch.hparams for t in cluster.train_inputs] == [cfg.train, cfg.train]
        p = await progress(handle)
        assert p.state == "completed" and not [e for e in p.events if e.kind == "hparams_set"]

    scenario(cluster, body)


def test_continue_as_new_carries_the_summary() -> None:
    cluster = Cluster()
    steps = 7  # runs of 3 + 3 + 1 steps

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=steps, steps_per_workflow_run=3))
        summary = await finish(handle)
        assert (summary.steps, summary.policy_version, summary.data_cursor) == (steps, steps, steps * PROMPTS_PER_STEP)
        # first five steps vs last five steps (SUMMARY_STEPS), across both boundaries
        assert summary.first_reward_mean == pytest.approx(sum(reward_of(n) for n in range(1, 6)) / 5)
        assert summary.last_reward_mean == pytest.approx(sum(reward_of(n) for n in range(3, 8)) / 5)
        assert summary.final_weights_key.endswith(f"v{steps:06d}")

        first = env.client.get_workflow_handle(handle.id, run_id=handle.first_execution_run_id)
        assert (await first.describe()).status == WorkflowExecutionStatus.CONTINUED_AS_NEW
        latest = env.client.get_workflow_handle(handle.id)
        assert (await latest.describe()).run_id != handle.first_execution_run_id
        p = await progress(latest)
        assert_committed_once(cluster, steps, p.steps)
        # the placement travelled with the state: data prepared and node claimed once
        assert len(cluster.served(PREPARE_DATA)) == 1 and len(cluster.served(INIT_POLICY)) == 1

    scenario(cluster, body)


def test_divergence_pauses_then_resume_retries_the_step() -> None:
    cluster = Cluster()

    async def nan_once(queue: str, attempt: int) -> None:
        if len(cluster.served(TRAIN_STEP, 2)) == 1:
            raise failure(Failure.DIVERGENCE, "step 2: non-finite ['loss']")

    cluster.hook(TRAIN_STEP, 2, nan_once)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=3))
        p = await wait_progress(handle, lambda p: p.state == "paused", "the divergence to pause the run")
        assert (p.step, p.policy_version, p.data_cursor) == (1, 1, PROMPTS_PER_STEP)
        diverged = [e for e in p.events if isinstance(e, Divergence)]
        assert [e.step for e in diverged] == [2] and "non-finite" in diverged[0].message
        assert [c.attempt for c in cluster.served(TRAIN_STEP, 2)] == [1]  # non-retryable

        await handle.execute_update(TrainingRun.set_hparams, HParamUpdate(lr=5e-5))  # the advised fix
        await handle.signal(TrainingRun.resume)
        summary = await finish(handle)
        assert (summary.steps, summary.policy_version) == (3, 3)
        assert len(cluster.served(ROLLOUT, 2)) == 2  # the step was re-run from its start
        assert [(t.batch.step, t.batch.hparams.lr) for t in cluster.train_inputs] == [(1, 1e-4), (2, 5e-5), (3, 5e-5)]
        assert_committed_once(cluster, 3, (await progress(handle)).steps)

    scenario(cluster, body)


def test_step_summary_reports_engine_retries_and_reused_chunks() -> None:
    cluster = Cluster()
    cluster.rollout_extra[2] = {"engine_retries": 2, "chunks_reused": 1}

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=2))
        await finish(handle)
        p = await progress(handle)
        assert [(s.engine_retries, s.chunks_reused) for s in p.steps] == [(0, 0), (2, 1)]

    scenario(cluster, body)


def test_a_kept_version_is_checkpointed_after_its_step() -> None:
    """``checkpoint.keep_versions``: its steps are checkpoint steps besides every k-th and the last;
    only the last one waits to be durable."""
    cluster = Cluster()

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        summary = await finish(await start_run(env, run_config(steps=5, checkpoint={"every": 2, "keep_versions": [3]})))
        assert summary.steps == 5
        assert [(c.step, c.durable) for c in cluster.checkpoint_inputs] == [
            (2, False), (3, False), (4, False), (5, True)]

    scenario(cluster, body)


def test_the_run_sends_the_trainer_its_setup_and_each_steps_batch_whole() -> None:
    """``init_policy`` carries the trainer's ``RunSetup`` built from the config's own sections
    (non-default values, so a dropped field shows) and ``train_step`` the ``StepBatch`` the
    trainer stores for replay: no field is copied on the way (the node only adds its id)."""
    cluster = Cluster()
    cfg = run_config(
        steps=2, seed=5, train={"lr": 1.5e-5, "clip_eps_high": 0.28, "kl_coef": 0.05, "ppo_epochs": 3},
        sft={"steps": 7, "batch_size": 3, "lr": 2e-3},
        model={"init": {"arch": "llama", "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 300},
               "lora": {"r": 4, "alpha": 3.0, "target_modules": ["q_proj"]}},
        distill={"teacher_path": "/t", "coef": 0.5},
        checkpoint={"every": 2, "keep_last": 9, "keep_versions": [1]},
    )

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        await finish(await start_run(env, cfg))
        ((_, init),) = cluster.init_inputs
        setup = init.setup
        assert (setup.seed, setup.model, setup.sft, setup.hparams, setup.distill, setup.trainer) == (
            5, cfg.model, cfg.sft, cfg.train, cfg.distill, cfg.trainer)
        assert (setup.keep_last, setup.keep_versions, setup.epoch, setup.lineage) == (9, [1], 1, [])
        assert setup.dataset_key.endswith("/data/train.jsonl") and setup.node_id == ""  # the node fills it in
        assert type(setup).model_validate_json(setup.model_dump_json()) == setup  # the RPC's JSON reads back whole
        batches = [t.batch for t in cluster.train_inputs]
        assert [(b.step, b.policy_version, b.group_size, b.hparams) for b in batches] == [
            (1, 0, cfg.rollout.group_size, cfg.train), (2, 1, cfg.rollout.group_size, cfg.train)]

    scenario(cluster, body)
