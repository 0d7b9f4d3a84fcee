"""Fencing with a real partition: the node running a step is stopped (SIGSTOP of its
agent, trainer, router and engines) until the run has moved to the other node, then
continued. The left-behind node finishes its step and tries to write: every write is
refused (a ``stale_write_refused`` event names the node and its epoch), nothing in the
run's store changes, and the run ends bitwise equal to its fault-free twin."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
from pathlib import Path

import pytest

from gpu_runtime.store.fence import read_fence
from gpu_runtime.store.object_store import LocalStore
from spec.events import NodeClaimed, NodeLost, StaleWriteRefused
from tests.e2e.faults import (
    Baselines, assert_bitwise_equal, assert_trained_exactly_once, final_weights, module_stack_fixtures, progress,
    start_run, wait_activity_started,
)
from tests.stack import Stack, async_wait_for, tiny_config
from workers.common import connect
from workflows.stubs import TRAIN_STEP
from workflows.training_run import TrainingRun

pytestmark = pytest.mark.e2e
STEPS = 3
CFG = {"steps": STEPS, "checkpoint": {"every": 3, "keep_last": 2}}  # the same as test_process_faults' CFG
ENV = {"MILESTONE_FAULT_TRAIN_DELAY_S": "2"}  # each train step waits first: the stop lands inside it

stack, store = module_stack_fixtures("fencing", ENV, gpu_nodes=("node0", "node1"))


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_partitioned_node_writes_nothing_the_run_uses(stack: Stack, store: Path, baselines: Baselines) -> None:
    baseline = baselines.weights(tiny_config(store, **CFG))
    run_id = "partition"

    async def main() -> None:
        client = await connect(stack.server.address)
        handle = await start_run(client, run_id, tiny_config(store, **CFG))
        await wait_activity_started(client, f"{run_id}/step-2", TRAIN_STEP.name)
        lost = (await progress(client, run_id)).node_queue
        assert lost is not None
        node_id = lost.split("-")[1]
        node = [stack.procs[f"gpu-{node_id}"].pid, *stack.node_children(node_id)]
        for pid in node:
            os.kill(pid, signal.SIGSTOP)
        try:
            async def moved() -> bool:
                return (await progress(client, run_id)).node_queue not in (lost, None)

            await async_wait_for(moved, 120, what="the run to move to the other node")
            await handle.signal(TrainingRun.pause)  # the run stops after step 2 (re-run on the other node)

            async def paused() -> bool:
                p = await progress(client, run_id)
                return p.state == "paused" and p.step == 2

            await async_wait_for(paused, 300, what="step 2 committed on the other node, run paused")
            before = tree(store / "runs" / run_id)
        finally:
            for pid in node:  # the partition heals
                os.kill(pid, signal.SIGCONT)

        async def refused() -> list:
            return [e for e in (await progress(client, run_id)).events if isinstance(e, StaleWriteRefused)]

        events = await async_wait_for(refused, 180, what="the left-behind node's write to be refused")
        assert (events[0].node, events[0].epoch) == (node_id, 1), events[0]
        assert "the run is at epoch 2" in events[0].error
        assert tree(store / "runs" / run_id) == before  # nothing it wrote landed

        await handle.signal(TrainingRun.resume)
        await asyncio.wait_for(handle.result(), 300)
        p = await progress(client, run_id)
        lost_events = [e.message for e in p.events if isinstance(e, NodeLost)]
        assert len(lost_events) == 1 and "no liveness heartbeat" in lost_events[0], lost_events
        fence = read_fence(LocalStore(store), run_id)
        assert fence.epoch == 2 and fence.node != node_id and [h.from_step for h in fence.history] == [1, 2]

    asyncio.run(main())
    assert_trained_exactly_once(store, run_id, tiny_config(store, **CFG))
    assert_bitwise_equal(final_weights(store, run_id, STEPS), baseline)


def test_concurrent_runs_take_different_nodes(stack: Stack, store: Path) -> None:
    """Two runs started together on two agents: the second claim is refused by the busy agent
    (NodeBusy, retried) and lands on the free one; each run stays on its node."""
    async def main() -> None:
        client = await connect(stack.server.address)
        handles = [await start_run(client, run_id, tiny_config(store, **CFG)) for run_id in ("pair-a", "pair-b")]
        await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), 600)
        claimed = []
        for run_id in ("pair-a", "pair-b"):
            events = (await progress(client, run_id)).events
            claimed.append([e.queue for e in events if isinstance(e, NodeClaimed)])
            assert not [e for e in events if e.kind == "node_lost"], events
        assert len(claimed[0]) == len(claimed[1]) == 1 and claimed[0] != claimed[1], claimed

    asyncio.run(main())
