"""Engine faults during a real run (DESIGN §7): the run heals itself and ends with
weights bitwise equal to the same run without the fault."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.client import Client

from tests.e2e.faults import (
    Baselines, assert_bitwise_equal, final_weights, kill_engines, module_stack_fixtures, run_with_fault,
)
from tests.stack import Stack, tiny_config
from workers.common import connect
from workflows.run_state import RunProgress
from workflows.stubs import ROLLOUT

pytestmark = pytest.mark.e2e
STEPS = 3
# decoding is slowed (fault-injection aid) so a kill lands while a chunk is generating.
# The router resends a dead engine's chunk by itself, so the node learns of the death
# from its health sweep (every 1 s): the resent chunk must outlast a sweep for the death
# to count in the step's engine_retries. Responses here are ~2 tokens: 2 x 600 ms > 1 s.
ENV = {"MILESTONE_ENGINE_STEP_DELAY_MS": "600"}

stack, store = module_stack_fixtures("engine-faults", ENV)


@pytest.fixture(scope="module")
def baseline(baselines: Baselines, store: Path) -> dict:
    return baselines.weights(tiny_config(store, steps=STEPS))


async def _activity_attempts(client: Client, workflow_id: str, activity: str) -> int:
    """The attempt on which ``activity`` of ``workflow_id`` finally ran (1: never retried)."""
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    names = {
        e.event_id: e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events if e.HasField("activity_task_scheduled_event_attributes")
    }
    started = [
        e.activity_task_started_event_attributes for e in history.events
        if e.HasField("activity_task_started_event_attributes")
    ]
    return max(a.attempt for a in started if names[a.scheduled_event_id] == activity)


def _kill_engines_during_step2_rollout(
    stack: Stack, store: Path, run_id: str, slots: list[int], cfg: dict | None = None
) -> tuple[RunProgress, list[int], int]:
    """Kill engine ``slots`` while step 2 generates; returns the run's progress, the
    killed engines' pids and the attempt on which step 2's rollout succeeded."""
    cfg = cfg or tiny_config(store, steps=STEPS)
    summary, p, engines = run_with_fault(stack, run_id, cfg, (2, ROLLOUT), lambda s: kill_engines(s, slots))
    assert summary.steps == STEPS and summary.policy_version == STEPS

    async def attempts() -> int:
        return await _activity_attempts(await connect(stack.server.address), f"{run_id}/step-2", ROLLOUT.name)

    return p, engines, asyncio.run(attempts())


def _one_engine_killed_with_weight_sync(stack: Stack, store: Path, baseline: dict, run_id: str, sync: str) -> str:
    """Run with ``engines.weight_sync: sync``, engine 0 killed mid-rollout: healed, every
    engine on the last version, bitwise equal to the store-synced baseline. The survivor's log."""
    cfg = tiny_config(store, steps=STEPS, engines={"weight_sync": sync})
    p, old_pids, _ = _kill_engines_during_step2_rollout(stack, store, run_id, [0], cfg)
    assert "engine_dead" in [e.kind for e in p.events]
    assert all(e.state == "healthy" for e in p.engines) and p.engines[0].pid != old_pids[0]
    assert {e.weight_version for e in p.engines} == {STEPS} and len({e.checksum for e in p.engines}) == 1
    assert_bitwise_equal(final_weights(store, run_id, STEPS), baseline)
    return (stack.workdir / "nodes" / "node0" / "logs" / "engine-1.log").read_text()


def test_one_engine_killed_mid_rollout(stack: Stack, store: Path, baseline: dict) -> None:
    p, old_pids, _ = _kill_engines_during_step2_rollout(stack, store, "kill-one", [0])
    kinds = [e.kind for e in p.events]
    assert "engine_dead" in kinds and "engine_recovered" in kinds, kinds
    # the kill landed mid-chunk: step 2's rollout resent the dead engine's chunk to the survivor
    retries = {s.step: s.engine_retries for s in p.steps}
    assert retries[2] >= 1, (retries, p.events)
    # the slot was restarted with a new process, serves the newest version, checksums agree
    assert all(e.state == "healthy" for e in p.engines)
    assert p.engines[0].pid != old_pids[0] and p.engines[0].restart_count >= 1
    assert {e.weight_version for e in p.engines} == {STEPS}
    assert len({e.checksum for e in p.engines}) == 1
    assert_bitwise_equal(final_weights(store, "kill-one", STEPS), baseline)
    scraped = stack.scrape("node0")
    assert scraped['milestone_engine_events_total{kind="engine_dead"}'] >= 1
    assert scraped['milestone_engine_events_total{kind="engine_recovered"}'] >= 1
    assert scraped["milestone_engines_healthy"] == 2


def test_all_engines_killed_run_waits_and_continues(stack: Stack, store: Path, baseline: dict) -> None:
    p, old_pids, rollout_attempts = _kill_engines_during_step2_rollout(stack, store, "kill-all", [0, 1])
    # no survivor to resend to: the attempt failed (NoHealthyEngine), the slots were
    # restarted and Temporal retried the rollout (engine_retries only counts deaths
    # within the attempt that succeeded, so it cannot show this case)
    assert rollout_attempts >= 2
    assert all(e.state == "healthy" for e in p.engines)
    assert all(e.pid not in old_pids for e in p.engines)
    # nothing lost or duplicated: one committed step per step, cursor advanced exactly
    assert [s.step for s in p.steps] == [1, 2, 3]
    assert p.data_cursor == STEPS * 4
    assert_bitwise_equal(final_weights(store, "kill-all", STEPS), baseline)


def test_shared_memory_weight_sync_with_an_engine_killed(stack: Stack, store: Path, baseline: dict) -> None:
    """``engines.weight_sync: shared_memory``: every push goes through a /dev/shm segment, an
    engine killed mid-rollout is healed (from the folder), and the run ends bitwise equal to
    the store-synced baseline: the sync path changes nothing the run computes."""
    survivor_log = _one_engine_killed_with_weight_sync(stack, store, baseline, "kill-one-shm", "shared_memory")
    assert "updated weights from shared memory" in survivor_log


def test_distributed_weight_sync_with_an_engine_killed(stack: Stack, store: Path, baseline: dict) -> None:
    """``engines.weight_sync: distributed``: the trainer broadcasts every version over a
    gloo group formed per push (the restarted engine joins the next one), an engine
    killed mid-rollout is healed, and the run ends bitwise equal to the store-synced
    baseline."""
    survivor_log = _one_engine_killed_with_weight_sync(stack, store, baseline, "kill-one-dist", "distributed")
    # versions 1..STEPS (and 0) reached the survivor by broadcast, not from disk
    assert survivor_log.count("updated weights from distributed group") >= STEPS
