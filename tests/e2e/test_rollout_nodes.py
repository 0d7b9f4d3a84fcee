"""Rollout nodes on one machine (``engines.nodes``): a trainer node and rollout-only agents,
each a real ``workers.gpu`` process with its own engines, on loopback. The multi-host bed
(tests/e2e/test_multi_host.py) runs the same rows across network namespaces.

A run whose chunks are spread over two rollout nodes trains bitwise what the colocated run
trains, every sample stamped with the node that made it, and between checkpoints no weight
byte reaches the store (the rollout nodes pull each version from the trainer's node).

The faults (a rollout host lost, partitioned, the trainer host lost, a host joining) are the
multi-host bed's rows (tests/e2e/test_multi_host.py).
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from tests.e2e.faults import (
    Baselines, assert_bitwise_equal, assert_trained_exactly_once, final_weights, progress, start_run,
)
from tests.recorded_histories import record
from tests.stack import Stack, tiny_config
from workers.common import connect
from workflows.run_state import RunProgress, RunSummary
from workflows.training_run import RUN_WORKFLOWS

pytestmark = pytest.mark.e2e

ROLLOUT_ONLY = ("--role", "rollout")


@pytest.fixture(scope="module")
def stack(plain_stack: Stack) -> Iterator[Stack]:
    """The session's plain stack (its node0 trains) with two rollout-only agents for this module:
    they poll only the rollout pool, so no other module's run is placed on them."""
    agents = [f"gpu-{node}" for node in ("rollout1", "rollout2")]
    for name in agents:
        plain_stack.start_gpu(name.removeprefix("gpu-"), extra=ROLLOUT_ONLY)
    try:
        yield plain_stack
    finally:
        for name in agents:
            plain_stack.kill(name, signal.SIGTERM)  # a graceful stop: its engines stop with it


def config(store: Path, **engines: object) -> dict:
    # checkpoints only after the last step: steps 1..2 are non-checkpoint steps
    return tiny_config(store, steps=3, checkpoint={"every": 3, "keep_last": 2},
                       rollout={"prompts_per_step": 4, "group_size": 4, "chunk_size": 4, "max_new_tokens": 4},
                       engines={"num_engines": 1, "health_check_interval_s": 1, "health_check_timeout_s": 5,
                                **engines})


def run(stack: Stack, run_id: str, cfg: dict, record_as: dict[str, str]) -> tuple[RunSummary, RunProgress]:
    """Run ``cfg`` to its end; its histories replay against the workflow code, and ``record_as``
    (recording name -> workflow id) are recorded with MILESTONE_RECORD_HISTORY."""
    async def main() -> tuple[RunSummary, RunProgress]:
        client = await connect(stack.server.address)
        await start_run(client, run_id, cfg)
        summary = await asyncio.wait_for(client.get_workflow_handle(run_id, result_type=RunSummary).result(), 400)
        replayer = Replayer(workflows=RUN_WORKFLOWS, data_converter=pydantic_data_converter)
        ids = [run_id, *(f"{run_id}/step-{s}" for s in range(1, cfg["steps"] + 1))]
        for wid in ids:
            history = await client.get_workflow_handle(wid).fetch_history()
            await replayer.replay_workflow(history)
            for name, recorded in record_as.items():
                if recorded == wid:
                    record(name, history)  # tests/recorded_histories.py: with MILESTONE_RECORD_HISTORY
        return summary, await progress(client, run_id)

    return asyncio.run(main())


def stamped_nodes(store: Path, run_id: str, steps: int) -> set[str]:
    """The node ids stamped on the chunks the run's steps trained."""
    nodes = set()
    for step in range(1, steps + 1):
        batch = json.loads((store / "runs" / run_id / "steps" / f"{step:06d}" / "step_batch.json").read_text())
        nodes |= {json.loads((store / key).read_text())["node"] for key in batch["chunk_keys"]}
    return nodes


def test_chunks_spread_over_rollout_nodes_train_what_the_colocated_run_trains(
    stack: Stack, baselines: Baselines,
) -> None:
    store = stack.workdir / "store"
    cfg = config(store, nodes=2)
    summary, prog = run(stack, "spread", cfg, record_as={"training_run_rollout_nodes": "spread"})
    assert summary.steps == 3
    rollout_ids = {n.node_id for n in prog.rollout_nodes}
    assert len(rollout_ids) == 2 and prog.node_queue is not None
    assert {e.node for e in prog.engines} == rollout_ids  # status: engines on two node ids
    assert stamped_nodes(store, "spread", 3) == rollout_ids  # each sample names the node that made it
    assert_trained_exactly_once(store, "spread", cfg)
    # between checkpoints no weight byte reaches the store: only v0 (the SFT warm-up) and the checkpointed v3
    assert sorted(p.name for p in (store / "runs" / "spread" / "weights").iterdir()) == ["v000000", "v000003"]
    colocated = baselines.weights(config(store))  # engines.nodes 0, otherwise the same run
    assert_bitwise_equal(final_weights(store, "spread", 3), colocated)


def test_one_step_off_samples_ahead_on_the_rollout_nodes_while_the_trainer_node_trains(
    stack: Stack, baselines: Baselines,
) -> None:
    """one_step_off: step n+1's batch is generated on the rollout nodes during step n's train step on
    the trainer node (the overlap disaggregation is for); the weights are bitwise the colocated run's."""
    store = stack.workdir / "store"
    mode = {"rollout": {"prompts_per_step": 4, "group_size": 4, "chunk_size": 4, "max_new_tokens": 4,
                        "mode": "one_step_off"}}
    cfg = {**config(store, nodes=2), **mode}
    summary, prog = run(stack, "spread-one-step-off", cfg, record_as={})
    assert summary.steps == 3
    assert [s.rollout_version for s in prog.steps] == [0, 0, 1]  # step 2's batch sampled during step 1
    assert stamped_nodes(store, "spread-one-step-off", 3) == {n.node_id for n in prog.rollout_nodes}
    assert_trained_exactly_once(store, "spread-one-step-off", cfg)
    colocated = baselines.weights({**config(store), **mode})
    assert_bitwise_equal(final_weights(store, "spread-one-step-off", 3), colocated)
