"""``engines.weight_sync: distributed`` across nodes, on one machine: a trainer node and two
rollout-only agents (real ``workers.gpu`` processes, each with its own engines, on loopback);
every push forms one gloo group of the trainer (rank 0) and the engines of both rollout nodes.

- the spread run completes bitwise equal to the same run with ``weight_sync: store`` (where
  each rollout node pulls every version from the trainer's node); every engine reports the
  trainer's checksum for every version, each version reached each node by broadcast
  (``weights_received``, no ``weight_sync_fallback``), and no rollout node ever pulled a
  trained version (none is on their disks);
- one rollout node's engine SIGKILLed inside step 2's broadcast (the trainer holds the group
  for ``BROADCAST_DELAY_S`` after every member joined): the group breaks within its timeout,
  the engines it did not reach pull the version (``weight_sync_fallback``), the dead one is
  restarted by the node's retried push, and the run completes, bitwise.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_runtime.proc.processes import pid_alive
from gpu_runtime.trainer.work_dir import engine_weights_folder
from tests.e2e.faults import assert_bitwise_equal, assert_trained_exactly_once, final_weights, progress, start_run
from tests.stack import Stack, running_stack, tiny_config, wait_for
from workers.common import connect
from workflows.run_state import RunProgress, RunSummary

pytestmark = pytest.mark.e2e

ROLLOUT_ONLY = ("--role", "rollout")
BROADCAST_DELAY_S = 3  # the trainer, after every member joined and before its first tensor: a kill lands inside
ENV = {"MILESTONE_FAULT_WEIGHT_BROADCAST_DELAY_S": str(BROADCAST_DELAY_S)}
STEPS = 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """node0 trains; node1 and node2 serve rollouts only."""
    with running_stack(tmp_path_factory.mktemp("rollout-broadcast"), env=ENV) as s:
        for node in ("node1", "node2"):
            s.start_gpu(node, extra=ROLLOUT_ONLY)
        yield s


def config(store: Path, weight_sync: str) -> dict:
    # checkpoints only after the last step: steps 1..2 are non-checkpoint steps
    return tiny_config(store, steps=STEPS, checkpoint={"every": STEPS, "keep_last": 2},
                       rollout={"prompts_per_step": 4, "group_size": 4, "chunk_size": 4, "max_new_tokens": 4},
                       engines={"num_engines": 1, "nodes": 2, "weight_sync": weight_sync, "weight_sync_timeout_s": 10,
                                "health_check_interval_s": 1, "health_check_timeout_s": 5})


def run(stack: Stack, run_id: str, cfg: dict) -> tuple[RunSummary, RunProgress]:
    async def main() -> tuple[RunSummary, RunProgress]:
        client = await connect(stack.server.address)
        await start_run(client, run_id, cfg)
        summary = await asyncio.wait_for(client.get_workflow_handle(run_id, result_type=RunSummary).result(), 600)
        return summary, await progress(client, run_id)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def pulled(stack: Stack) -> dict[str, torch.Tensor]:
    """The final weights of the same run with ``weight_sync: store`` (every version pulled)."""
    store = stack.workdir / "store"
    summary, _ = run(stack, "pulled", config(store, "store"))
    assert summary.steps == STEPS
    return final_weights(store, "pulled", STEPS)


def step_events(prog: RunProgress, kind: str) -> list:
    """The run's events of ``kind`` (the steps' events move to the run's list as each step commits)."""
    return [e for e in prog.events if e.kind == kind]


def test_every_version_reaches_every_rollout_node_by_broadcast_bitwise(
    stack: Stack, pulled: dict[str, torch.Tensor],
) -> None:
    store = stack.workdir / "store"
    cfg = config(store, "distributed")
    summary, prog = run(stack, "bcast", cfg)
    assert summary.steps == STEPS
    rollout_ids = sorted(n.node_id for n in prog.rollout_nodes)
    assert len(rollout_ids) == 2
    assert_trained_exactly_once(store, "bcast", cfg)
    assert_bitwise_equal(final_weights(store, "bcast", STEPS), pulled)
    assert step_events(prog, "weight_sync_fallback") == []
    for s in prog.steps:
        version = str(s.policy_version)
        received = [e for e in step_events(prog, "weights_received") if e.version == version]
        assert len(received) == 2 and all(e.slots == [0] and e.nbytes > 0 for e in received), received
        assert len({e.group for e in received}) == 1  # one group spanned both nodes
        ok = [e for e in step_events(prog, "checksum_ok") if e.version == version]
        assert len(ok) == 2 and {e.checksum for e in ok} == {s.checksum}, ok  # every engine: the trainer's
    assert {e.node for e in prog.engines} == set(rollout_ids)
    assert {(e.weight_version, e.checksum) for e in prog.engines} == {(STEPS, prog.steps[-1].checksum)}
    # no rollout node pulled a trained version: only v0, which a node pulls when it joins the run
    for node in rollout_ids:
        trainer_dir = stack.workdir / "nodes" / node / "trainer"
        assert engine_weights_folder(trainer_dir, "bcast", 0).exists()
        assert not any(engine_weights_folder(trainer_dir, "bcast", v).exists() for v in range(1, STEPS + 1))


def engine_log(stack: Stack, node: str) -> Path:
    return stack.workdir / "nodes" / node / "logs" / "engine-0.log"


def test_an_engine_killed_inside_the_broadcast_pulls_and_the_run_completes_bitwise(
    stack: Stack, pulled: dict[str, torch.Tensor],
) -> None:
    store = stack.workdir / "store"
    cfg = config(store, "distributed")
    run_id = "bcast-kill"
    killed: list[tuple[str, int]] = []

    def kill_inside_step_2_broadcast() -> None:
        """SIGKILL the engine of the first rollout node seen receiving v2 from the group."""
        def receiving() -> tuple[str, int] | None:
            for node in ("node1", "node2"):
                path = engine_log(stack, node)
                if path.exists() and f"from group {run_id}/v2/" in path.read_text():
                    pids = stack.node_pids(node).get("engines", [])
                    return (node, pids[0]) if pids and pids[0] else None
            return None

        node, pid = wait_for(receiving, 400, interval_s=0.05, what="a rollout engine inside step 2's broadcast")
        os.kill(pid, signal.SIGKILL)
        killed.append((node, pid))
        wait_for(lambda: not pid_alive(pid), 30, what="the engine to die")

    async def main() -> tuple[RunSummary, RunProgress]:
        client = await connect(stack.server.address)
        await start_run(client, run_id, cfg)
        await asyncio.to_thread(kill_inside_step_2_broadcast)
        summary = await asyncio.wait_for(client.get_workflow_handle(run_id, result_type=RunSummary).result(), 600)
        return summary, await progress(client, run_id)

    summary, prog = asyncio.run(main())
    assert summary.steps == STEPS and killed
    fell_back = [e for e in step_events(prog, "weight_sync_fallback") if e.version == "2"]
    assert fell_back, "the engines the broken group did not reach pull v2"
    assert step_events(prog, "engine_dead")
    assert_trained_exactly_once(store, run_id, cfg)
    assert_bitwise_equal(final_weights(store, run_id, STEPS), pulled)
    # every engine serves the last version, with the trainer's checksum; the killed one was restarted
    assert {(e.weight_version, e.checksum, e.state) for e in prog.engines} == {
        (STEPS, prog.steps[-1].checksum, "healthy")}
    # step 3's push found the group whole again: by broadcast on both nodes
    assert len([e for e in step_events(prog, "weights_received") if e.version == str(STEPS)]) == 2
