"""``engines.weight_sync: distributed`` across hosts of the multi-host bed (tests/hosts.py): a
trainer host and two rollout-only hosts, each a network namespace with its own address and
files. Every push forms one gloo group across the three hosts: its store is hosted on the
trainer host's bed address (10.x, its ``--advertise-host``), each engine binds gloo on its own
host's bed address. The run completes bitwise equal to the same run with ``weight_sync:
store`` (each rollout host pulls every version from the trainer host), and every version
reached each rollout host by broadcast.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from temporalio.client import Client

from tests.e2e.faults import assert_bitwise_equal, progress, start_run
from tests.hosts import Bed, multi_host_bed_fixture  # noqa: F401  (fixture)
from tests.stack import tiny_config
from workflows.run_state import RunProgress, RunSummary

pytestmark = pytest.mark.e2e

STEPS = 3
BUCKET = f"bed-bcast-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def bed(multi_host_bed: Callable[..., Bed]) -> Bed:
    """node0 trains; node1 and node2 serve rollouts only."""
    b = multi_host_bed(3, agents=False)
    b.start_node("node0")
    for host in ("node1", "node2"):
        b.start_node(host, "--role", "rollout")
    return b


def config(bed: Bed, weight_sync: str) -> dict:
    return tiny_config(Path("/nonexistent"), steps=STEPS, store=bed.store_uri(BUCKET),
                       checkpoint={"every": STEPS, "keep_last": 2},
                       rollout={"prompts_per_step": 4, "group_size": 4, "chunk_size": 4, "max_new_tokens": 4},
                       engines={"num_engines": 1, "nodes": 2, "weight_sync": weight_sync, "weight_sync_timeout_s": 20,
                                "health_check_interval_s": 1, "health_check_timeout_s": 5})


def run(bed: Bed, run_id: str, weight_sync: str) -> tuple[RunSummary, RunProgress, dict[str, torch.Tensor]]:
    async def main(client: Client) -> tuple[RunSummary, RunProgress]:
        handle = await start_run(client, run_id, config(bed, weight_sync))
        summary = await asyncio.wait_for(handle.result(), 600)
        return summary, await progress(client, run_id)

    summary, prog = bed.call(main)
    weights = load_safetensors(bed.store(BUCKET).get_bytes(f"{summary.final_weights_key}/model.safetensors"))
    return summary, prog, weights


def test_a_gloo_group_spans_the_hosts_and_trains_what_the_pulled_run_trains(bed: Bed) -> None:
    _, _, pulled = run(bed, "bed-pulled", "store")
    summary, prog, weights = run(bed, "bed-bcast", "distributed")
    assert summary.steps == STEPS
    assert_bitwise_equal(weights, pulled)
    trainer = bed.hosts["node0"]
    assert prog.node_queue is not None and bed.host_of_queue(prog.node_queue) is trainer
    assert sorted(n.node_id for n in prog.rollout_nodes) == ["node1", "node2"]
    assert not [e for e in prog.events if e.kind == "weight_sync_fallback"]
    for v in range(1, STEPS + 1):
        received = [e for e in prog.events if e.kind == "weights_received" and e.version == str(v)]
        assert len(received) == 2 and len({e.group for e in received}) == 1, received
    # the group met on the trainer host's bed address, and each rollout host's engine joined it from its own
    assert f"store at {trainer.addr}:" in bed.log(trainer, "gpu")
    for host in ("node1", "node2"):
        engine_log = (bed.hosts[host].dir / "node" / "logs" / "engine-0.log").read_text()
        assert "updated weights from distributed group bed-bcast/v3/" in engine_log
        assert "seated at rank" in bed.log(host, "gpu")
