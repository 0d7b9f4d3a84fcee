"""Fencing in the workflows (time-skipping test server, stand-in activities): each
placement carries its epoch to every node activity (``assert_replaced`` checks it
after a node loss), and a node the run left behind reports its refused writes with
the ``node_event`` signal, which the run keeps among its events."""

from __future__ import annotations

from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from spec.events import StaleWriteRefused
from tests.unit.workflow_harness import Cluster, finish, progress, run_config, scenario, start_run, wait_progress
from workflows.stubs import TRAIN_STEP
from workflows.training_run import TrainingRun


def test_node_event_signal_is_a_run_event() -> None:
    cluster = Cluster()
    held = cluster.gate(TRAIN_STEP, 1)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=1))
        await held.wait_reached()
        assert [t.epoch for t in cluster.train_inputs] == []  # (recorded after the hook)
        refused = StaleWriteRefused(at="2026-01-01T00:00:00+00:00", node="n9", epoch=1,
                                    error="refused put runs/x/weights/v000002/model.safetensors")
        await handle.signal(TrainingRun.node_event, refused)
        await wait_progress(handle, lambda p: refused in p.events, "the signalled event")
        held.release.set()
        await finish(handle)
        assert refused in (await progress(handle)).events
        assert [t.epoch for t in cluster.train_inputs] == [1]

    scenario(cluster, body)
