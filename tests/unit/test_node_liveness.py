"""The node liveness watch (``workflows/node_watch.py``) on the time-skipping test server:
a node agent that stops heartbeating loses the run within ``node.liveness_timeout_s``,
its step is cancelled and re-run on another node; with the watch off nothing is started.

The test server does not skip time while an activity runs, so the timeout runs on the
wall clock: 1 s here."""

from __future__ import annotations

from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.unit.test_workflows import assert_replaced
from tests.unit.workflow_harness import Cluster, finish, progress, run_config, scenario, start_run
from spec.events import NodeLost
from workflows.stubs import TRAIN_STEP

FAST = {"liveness_timeout_s": 1.0, "liveness_interval_s": 0.2}


def test_silent_node_is_lost_and_its_step_rerun_elsewhere() -> None:
    cluster = Cluster(n_nodes=2)
    node_a, node_b = cluster.queues
    stuck = cluster.gate(TRAIN_STEP, 2)  # A hangs in step 2's train_step ...

    async def go_silent(queue: str, attempt: int) -> None:
        if queue == node_a:
            cluster.silent.add(node_a)  # ... and its agent stops heartbeating (SIGSTOP, partition)
            await stuck.hook(queue, attempt)

    cluster.hook(TRAIN_STEP, 2, go_silent)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=3, node=FAST))
        summary = await finish(handle)
        assert summary.steps == 3
        await assert_replaced(handle, cluster, node_a, node_b, lost_at_step=2)
        lost = [e.message for e in (await progress(handle)).events if isinstance(e, NodeLost)]
        assert "no liveness heartbeat for 1s (heartbeat timeout)" in lost[0], lost
        assert cluster.liveness_started == [node_a, node_b]  # one watch per placement, not per step
        stuck.release.set()

    scenario(cluster, body)


def test_watch_off_starts_nothing() -> None:
    cluster = Cluster()

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        assert (await finish(await start_run(env, run_config(steps=2, node={"liveness_timeout_s": 0})))).steps == 2
        assert cluster.liveness_started == []

    scenario(cluster, body)


def test_completed_run_has_no_pending_watch() -> None:
    """The run waits for its watch's cancel to be acknowledged before it closes: no
    pending activity is left on a completed run (the UI listed one before)."""
    cluster = Cluster()

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=2, node=FAST))
        assert (await finish(handle)).steps == 2
        desc = await handle.describe()
        assert list(desc.raw_description.pending_activities) == []
        assert cluster.liveness_started == [cluster.queues[0]]

    scenario(cluster, body)
