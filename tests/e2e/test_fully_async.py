"""``rollout.mode: fully_async`` (``max_staleness: 2``) in real runs: step 1 fills a buffer
of two batches on v0, each later step trains the oldest and samples one more beside its
train_step. The control worker killed mid-run and the Temporal server restarted mid-run
(both while a batch for a later step generates beside a train step) each end bitwise
equal to the fault-free fully_async run, every prompt trained once (asserted by the
prompt ids stored with each trained sample): the schedule is replayed from history,
never re-raced. A fork at step 2 (two batches buffered) without change carries the
parent's buffer and ends bitwise equal to it, and so does a ``--resume-from`` of a
run's step-2 checkpoint."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from gpu_runtime.data.datasets import prompts_for_step
from tests.e2e.test_fork import cli
from tests.e2e.faults import (
    assert_bitwise_equal,
    module_baseline_fixture,
    module_stack_fixtures,
    final_weights,
    progress,
    start_run,
    wait_activity_started,
)
import yaml

from tests.stack import Stack, tiny_config
from workers.common import connect
from workflows.stubs import ROLLOUT

pytestmark = pytest.mark.e2e
STEPS, K = 4, 2
# checkpoint at the end only; every batch is sampled on v0 (steps 1-3) or v1 (step 4)
CFG = {"steps": STEPS, "checkpoint": {"every": STEPS, "keep_last": 2},
       "rollout": {"mode": "fully_async", "max_staleness": K}}
# fault-injection aids: each train step waits 2 s first and each decoded token 300 ms, so a
# fault lands while a train step and the rollout of a later step's batch run side by side
ENV = {"MILESTONE_FAULT_TRAIN_DELAY_S": "2", "MILESTONE_ENGINE_STEP_DELAY_MS": "300"}
VERSIONS = [{0}, {0}, {0}, {1}]  # the weights each step's samples were generated on
STALENESS = [0, 1, 2, 2]


def cfg(store: Path) -> dict:
    return tiny_config(store, **CFG)


stack, store = module_stack_fixtures("fully-async", ENV)
baseline = module_baseline_fixture(cfg)


def trained_samples(store: Path, run_id: str, step: int) -> list[dict]:
    batch = json.loads((store / "runs" / run_id / "steps" / f"{step:06d}" / "step_batch.json").read_text())
    return [s for key in batch["chunk_keys"] for s in json.loads((store / key).read_text())["samples"]]


def assert_schedule_and_exactly_once(store: Path, run_id: str) -> None:
    """Each step trained exactly its prompts (seed, cursor), each once, in order, on
    samples the engines stamped with the version the schedule says."""
    c = cfg(store)
    p, g = c["rollout"]["prompts_per_step"], c["rollout"]["group_size"]
    run_dir = store / "runs" / run_id
    trained_steps = sorted(d.name for d in (run_dir / "steps").iterdir() if (d / "step_batch.json").exists())
    assert trained_steps == [f"{s:06d}" for s in range(1, STEPS + 1)]
    for step in range(1, STEPS + 1):
        samples = trained_samples(store, run_id, step)
        expected = prompts_for_step(c["data"]["num_train"], c["seed"], (step - 1) * p, p)
        assert [s["prompt_index"] for s in samples] == [i for i in expected for _ in range(g)], f"step {step}"
        assert {s["weight_version"] for s in samples} == VERSIONS[step - 1], f"step {step}"


async def assert_progress(client, run_id: str) -> None:
    p = await progress(client, run_id)
    assert p.state == "completed" and p.policy_version == STEPS
    assert [s.staleness for s in p.steps] == STALENESS
    assert [s.buffer_depth for s in p.steps] == [2, 2, 1, 0]


def test_fault_free_run_keeps_two_batches_ahead(stack: Stack, store: Path, baseline: dict) -> None:
    async def main() -> None:
        client = await connect(stack.server.address)
        await assert_progress(client, "baseline")
        p = await progress(client, "baseline")
        # steps 1 and 2 sample later batches beside their train step; 3 and 4 find them buffered
        assert [s.overlap_seconds > 0 for s in p.steps] == [True, True, False, False]

    asyncio.run(main())
    assert_schedule_and_exactly_once(store, "baseline")


def test_control_worker_killed_while_a_later_batch_generates(stack: Stack, store: Path, baseline: dict) -> None:
    run_id = "fa-control-crash"

    async def main() -> None:
        client = await connect(stack.server.address)
        handle = await start_run(client, run_id, cfg(store))
        # step 4's batch is generated inside step 2's workflow, beside step 2's train_step
        await wait_activity_started(client, f"{run_id}/step-2", ROLLOUT.name)
        stack.kill("control")
        stack.start_control()
        summary = await asyncio.wait_for(handle.result(), 300)
        assert summary.steps == STEPS and summary.data_cursor == STEPS * 4
        await assert_progress(client, run_id)

    asyncio.run(main())
    assert_schedule_and_exactly_once(store, run_id)
    assert_bitwise_equal(final_weights(store, run_id, STEPS), baseline)


def test_temporal_server_restarted_while_a_later_batch_generates(stack: Stack, store: Path, baseline: dict) -> None:
    run_id = "fa-server-restart"

    async def main() -> None:
        client = await connect(stack.server.address)
        await start_run(client, run_id, cfg(store))
        await wait_activity_started(client, f"{run_id}/step-2", ROLLOUT.name)
        stack.server.restart()  # same port, same SQLite file
        client = await connect(stack.server.address)
        summary = await asyncio.wait_for(client.get_workflow_handle(run_id).result(), 300)
        assert summary["steps"] == STEPS  # a handle without result_type gives the raw JSON
        await assert_progress(client, run_id)

    asyncio.run(main())
    assert_schedule_and_exactly_once(store, run_id)
    assert_bitwise_equal(final_weights(store, run_id, STEPS), baseline)


def test_fork_mid_buffer_without_change_equals_the_parent(stack: Stack, store: Path, baseline: dict) -> None:
    out = cli(stack, "fork", "baseline", "--from-step", "2", "--run-id", "fa-fork", "--wait")
    assert out.returncode == 0, out.stderr
    assert "fully_async: carries 2 batch(es) baseline sampled ahead after step 2" in out.stdout, out.stdout

    async def main() -> None:
        client = await connect(stack.server.address)
        p = await progress(client, "fa-fork")
        assert [s.step for s in p.steps] == [3, 4] and p.policy_version == STEPS
        assert [s.staleness for s in p.steps] == STALENESS[2:]

    asyncio.run(main())
    for step in (3, 4):  # the parent's batches, trained once each, by the fork
        assert trained_samples(store, "fa-fork", step) == trained_samples(store, "baseline", step)
    assert_bitwise_equal(final_weights(store, "fa-fork", STEPS), baseline)


def test_resume_mid_buffer_carries_the_buffer_and_equals_the_baseline(stack: Stack, store: Path, baseline: dict,
                                                                        tmp_path: Path) -> None:
    """``--resume-from`` a checkpoint taken with two batches buffered: the resumed run trains
    the batches its previous execution had sampled ahead (read from that step's workflow in
    Temporal), as the uninterrupted run did, instead of sampling them afresh on newer weights."""
    config = tmp_path / "fa.yaml"
    config.write_text(yaml.safe_dump(tiny_config(store, **{**CFG, "checkpoint": {"every": 2, "keep_last": 3}})))
    out = cli(stack, "start", str(config), "--run-id", "fa-resume", "--wait")
    assert out.returncode == 0, out.stderr
    first = {step: trained_samples(store, "fa-resume", step) for step in (3, 4)}
    out = cli(stack, "start", str(config), "--resume-from", f"file://{store}/runs/fa-resume/checkpoints/step-000002",
              "--wait")
    assert out.returncode == 0, out.stderr
    assert "resuming fa-resume at step 3" in out.stdout
    assert "fully_async: carries 2 batch(es) fa-resume sampled ahead after step 2" in out.stdout, out.stdout

    async def main() -> None:
        client = await connect(stack.server.address)
        p = await progress(client, "fa-resume")
        assert [s.step for s in p.steps] == [3, 4] and p.policy_version == STEPS
        assert [s.staleness for s in p.steps] == STALENESS[2:]

    asyncio.run(main())
    for step in (3, 4):  # the batches sampled before the checkpoint, on v0, as the baseline trained them
        assert trained_samples(store, "fa-resume", step) == first[step] == trained_samples(store, "baseline", step)
    assert_schedule_and_exactly_once(store, "fa-resume")
    assert_bitwise_equal(final_weights(store, "fa-resume", STEPS), baseline)
