"""Helpers for fault-injection tests: start runs, wait for a phase, compare weights."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import torch
from safetensors.torch import load_file
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from spec.run import RunConfig
from tests.stack import Stack, async_wait_for, running_stack
from workers.common import connect
from workflows.run_state import RunProgress, RunSummary, TrainingRunInput
from workflows.queues import CONTROL_QUEUE
from workflows.training_run import TrainingRun

STARTED = 2  # PendingActivityState.PENDING_ACTIVITY_STATE_STARTED


async def start_run(client: Client, run_id: str, cfg: dict) -> WorkflowHandle:
    return await client.start_workflow(
        TrainingRun.run, TrainingRunInput(config=RunConfig.model_validate(cfg)), id=run_id,
        task_queue=CONTROL_QUEUE, result_type=RunSummary,
    )


async def run_to_end(client: Client, run_id: str, cfg: dict, timeout_s: float = 300) -> RunSummary:
    handle = await start_run(client, run_id, cfg)
    return await asyncio.wait_for(handle.result(), timeout_s)


async def activity_started(client: Client, workflow_id: str, activity: str) -> bool:
    """True once ``activity`` of ``workflow_id`` has been picked up by a worker."""
    try:
        desc = await client.get_workflow_handle(workflow_id).describe()
    except RPCError:
        return False  # the child workflow does not exist yet
    return any(
        p.activity_type.name == activity and p.state == STARTED for p in desc.raw_description.pending_activities
    )


async def wait_activity_started(client: Client, workflow_id: str, activity: str, timeout_s: float = 180) -> None:
    await async_wait_for(
        lambda: activity_started(client, workflow_id, activity), timeout_s, what=f"{workflow_id} {activity} started"
    )


async def progress(client: Client, run_id: str) -> RunProgress:
    return await client.get_workflow_handle(run_id).query("progress", result_type=RunProgress)


def final_weights(store: Path, run_id: str, version: int) -> dict[str, torch.Tensor]:
    return load_file(str(store / "runs" / run_id / "weights" / f"v{version:06d}" / "model.safetensors"))


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"tensors differ: {diff[:5]}"


def baseline_weights(stack: Stack, store: Path, cfg: dict, run_id: str = "baseline") -> dict[str, torch.Tensor]:
    """Run ``cfg`` without faults and return its final weights (the bitwise reference)."""

    async def main() -> RunSummary:
        client = await connect(stack.server.address)
        summary = await run_to_end(client, run_id, cfg)
        # no false positive of the node liveness watch on this loaded machine
        lost = [e.detail for e in (await progress(client, run_id)).events if e.kind == "node_lost"]
        assert not lost, f"a fault-free run lost its node: {lost}"
        return summary

    summary = asyncio.run(main())
    return final_weights(store, run_id, summary.policy_version)


def module_stack_fixtures(name: str, env: dict[str, str], config: Callable[[Path], dict]) -> tuple:
    """The module-scoped ``stack``, ``store`` and ``baseline`` fixtures of a fault-injection
    module: one stack per module (its agents get ``env``) and the fault-free run of
    ``config(store)`` whose final weights every faulted run must equal bitwise. Use as
    ``stack, store, baseline = module_stack_fixtures("name", ENV, cfg)``."""

    @pytest.fixture(scope="module")
    def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
        with running_stack(tmp_path_factory.mktemp(name), env=env) as s:
            yield s

    @pytest.fixture(scope="module")
    def store(stack: Stack) -> Path:
        return stack.workdir / "store"

    @pytest.fixture(scope="module")
    def baseline(stack: Stack, store: Path) -> dict[str, torch.Tensor]:
        return baseline_weights(stack, store, config(store))

    return stack, store, baseline
