"""A fsdp2 cell whose ranks sit on two machines (issue #29): the multi-host bed (tests/hosts.py)
with a Ray cluster across two of its hosts (tests/ray_hosts.py): the Ray head on the trainer
node's host ``node0`` (2 CPUs) and a worker raylet on ``node1`` (1 CPU), the node agent on
``node0`` given the head as ``$MILESTONE_RAY_ADDRESS``. ``node1`` runs no node agent: it
lends the cluster a CPU, as a second machine of the trainer's Ray cluster would.

- ``trainer.placement: spread`` puts one rank on each host (``cells[].ranks[].node_ip`` lists
  both addresses, the second rank's process lives in node1's namespace); the run completes,
  its checkpoints hold both ranks' shards although no host sees another's files, and its
  final weights are bitwise those of the same run with both ranks on node0
  (``strict_pack``: only node0 has two CPUs). Two ranks add two partial gradients, and
  a + b is b + a in floating point, so where the ranks sit cannot change a bit.
- node1 lost (every process of the host SIGKILLed) inside step 2's ``train_step``: the
  step fails, the trainer drops the cell and its retry builds a new one (from the
  checkpoint of step 1 plus replay, as after a rank kill) on the CPUs the cluster has left,
  both ranks on node0; the run completes bitwise equal to the fault-free spread run.

Heavy (Ray head + worker raylet + the bed's services + a node agent on 2 cores): run under
the shared e2e lock.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray  # noqa: F401  (a dev dependency: imported, so a broken install fails loudly)
import torch
from safetensors.torch import load as load_safetensors
from temporalio.client import Client

from gpu_runtime.proc.processes import pid_alive, stop_pid
from gpu_runtime.trainer.fsdp2.host import RAY_ADDRESS_ENV
from spec.events import CellFailed
from tests.e2e.faults import assert_bitwise_equal, progress, start_run, wait_activity_started
from tests.hosts import Bed, Host, multi_host_bed_fixture  # noqa: F401  (fixture)
from tests.ray_hosts import RAY_PORT, RayNode, start_ray_head, start_ray_worker, wait_ray_node_dead
from tests.stack import async_wait_for, tiny_config
from workflows.run_state import RunProgress, RunSummary
from workflows.stubs import TRAIN_STEP

pytestmark = pytest.mark.e2e

STEPS = 2
BUCKET = f"ranks-{uuid.uuid4().hex[:12]}"
RUN_TIMEOUT_S = 900  # two cores shared by Ray, the bed's services and the run
ENV = {"MILESTONE_FAULT_TRAIN_DELAY_S": "2"}  # each train step waits first, so a host kill lands inside it


@dataclass
class Cluster:
    """The bed and its Ray cluster: the head on ``trainer`` (node0), a worker on ``worker`` (node1)."""

    bed: Bed
    head: RayNode
    worker: RayNode

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{RAY_PORT}"

    @property
    def trainer(self) -> Host:
        return self.head.host

    @property
    def other(self) -> Host:
        return self.worker.host


@pytest.fixture(scope="module")
def cluster(multi_host_bed: Callable[..., Bed]) -> Iterator[Cluster]:
    bed = multi_host_bed(2, agents=False, env=ENV)
    node0, node1 = bed.nodes
    head = start_ray_head(node0, num_cpus=2)
    worker: RayNode | None = None
    try:
        worker = start_ray_worker(node1, head, num_cpus=1)
        bed.start_node(node0, env={RAY_ADDRESS_ENV: f"{head.ip}:{RAY_PORT}"})
        yield Cluster(bed, head, worker)
    finally:  # by pid: the node agent first (its trainer closes the cell, which the head would
        # otherwise drain for up to 30 s), then the raylets; the bed's stop kills whatever is left
        agent = node0.procs.get("gpu")
        if agent is not None:
            stop_pid(agent.pid, agent, timeout_s=30)
        if worker is not None:
            worker.stop()
        head.stop()


def cfg(bed: Bed, placement: str) -> dict:
    # as tests/e2e/test_trainer_cell_run.py: 16 samples per step in micro-batches of 4, 2 per rank
    return tiny_config(Path("/nonexistent"), steps=STEPS, store=bed.store_uri(BUCKET), sft={"steps": 20},
                       train={"lr": 1e-3, "micro_batch_size": 4}, checkpoint={"every": 1, "keep_last": 2},
                       eval={"enabled": False}, engines={"num_engines": 1},
                       trainer={"backend": "fsdp2", "ranks_per_cell": 2, "placement": placement})


@dataclass(frozen=True)
class FinishedRun:
    summary: RunSummary
    progress: RunProgress
    weights: dict[str, torch.Tensor]


def final_weights(bed: Bed, summary: RunSummary) -> dict[str, torch.Tensor]:
    return load_safetensors(bed.store(BUCKET).get_bytes(f"{summary.final_weights_key}/model.safetensors"))


def run(cluster: Cluster, run_id: str, placement: str) -> FinishedRun:
    bed = cluster.bed

    async def main(client: Client) -> tuple[RunSummary, RunProgress]:
        handle = await start_run(client, run_id, cfg(bed, placement))
        summary = await asyncio.wait_for(handle.result(), RUN_TIMEOUT_S)
        return summary, await progress(client, run_id)

    summary, p = bed.call(main, timeout_s=RUN_TIMEOUT_S + 60)
    return FinishedRun(summary, p, final_weights(bed, summary))


@pytest.fixture(scope="module")
def one_host(cluster: Cluster) -> FinishedRun:
    """The reference: both ranks on node0 (``strict_pack``; only node0 has two CPUs)."""
    return run(cluster, "one-host", "strict_pack")


@pytest.fixture(scope="module")
def spread(cluster: Cluster, one_host: FinishedRun) -> FinishedRun:
    """The same run with ``placement: spread``: a rank on each host."""
    return run(cluster, "spread", "spread")


def rank_ips(p: RunProgress) -> list[str]:
    assert len(p.cells) == 1, p.cells
    return [r.node_ip for r in p.cells[0].ranks]


def test_spread_cell_trains_across_hosts_as_on_one(cluster: Cluster, one_host: FinishedRun,
                                                  spread: FinishedRun) -> None:
    trainer, other = cluster.trainer, cluster.other
    assert sorted(rank_ips(one_host.progress)) == [trainer.addr, trainer.addr]
    assert sorted(rank_ips(spread.progress)) == sorted([trainer.addr, other.addr])
    cell = spread.progress.cells[0]
    assert cell.placement == "spread" and cell.ray_address == cluster.address, cell
    remote = [r.pid for r in cell.ranks if r.node_ip == other.addr]
    assert set(remote) <= set(other.pids()), "the rank on node1 is a process of node1's namespace"
    for run_ in (one_host, spread):
        assert run_.summary.steps == STEPS and run_.progress.state == "completed"
        assert not [e for e in run_.progress.events if isinstance(e, CellFailed)], run_.progress.events
    # the shards of both ranks reach the store, though rank 1 wrote its own on another host
    keys = cluster.bed.store(BUCKET).list(f"runs/spread/checkpoints/step-{STEPS:06d}/")
    shards = sorted(k.rsplit("/", 1)[-1] for k in keys if "/shards/" in k and k.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"], keys
    assert [s.loss for s in spread.progress.steps] == [s.loss for s in one_host.progress.steps]
    assert_bitwise_equal(spread.weights, one_host.weights)


def test_losing_a_ranks_host_mid_step_heals_bitwise(cluster: Cluster, spread: FinishedRun) -> None:
    """Last in the module: node1 stays lost."""
    bed, trainer, other = cluster.bed, cluster.trainer, cluster.other
    run_id = "host-lost"

    async def until_step_2_trains(client: Client) -> RunProgress:
        await start_run(client, run_id, cfg(bed, "spread"))

        async def committed() -> RunProgress | None:
            p = await progress(client, run_id)
            return p if p.step >= 1 and p.cells else None

        p = await async_wait_for(committed, RUN_TIMEOUT_S, interval_s=0.2, what="step 1 committed")
        await wait_activity_started(client, f"{run_id}/step-2", TRAIN_STEP.name, timeout_s=RUN_TIMEOUT_S)
        return p

    before = bed.call(until_step_2_trains, timeout_s=RUN_TIMEOUT_S + 60)
    assert sorted(rank_ips(before)) == sorted([trainer.addr, other.addr]), before.cells
    [lost] = [r for r in before.cells[0].ranks if r.node_ip == other.addr]
    killed = other.kill_all()
    assert lost.pid in killed and not pid_alive(lost.pid)

    async def to_end(client: Client) -> tuple[RunSummary, RunProgress]:
        summary = await asyncio.wait_for(client.get_workflow_handle(run_id, result_type=RunSummary).result(),
                                         RUN_TIMEOUT_S)
        return summary, await progress(client, run_id)

    summary, p = bed.call(to_end, timeout_s=RUN_TIMEOUT_S + 60)
    assert summary.steps == STEPS and p.state == "completed"
    assert p.steps[1].restored_from_step is not None, p.steps[1]  # the cell was rebuilt from a checkpoint
    # as a rank kill: the rank's actor is gone (Ray: unreachable), so the call fails with CellRankDied
    died = [e for e in p.events if isinstance(e, CellFailed) and e.kind == "cell_rank_died"]
    assert died and f"rank {lost.rank} of the cell died" in died[0].message, p.events
    after = p.cells[0]
    assert after.generation > before.cells[0].generation, (before.cells, p.cells)
    assert rank_ips(p) == [trainer.addr, trainer.addr], "the rebuilt cell sits on the CPUs the cluster has left"
    assert_bitwise_equal(final_weights(bed, summary), spread.weights)
    # the cluster itself counts node1 lost (later: the heal did not wait for it)
    wait_ray_node_dead(trainer, cluster.address, other.addr)
