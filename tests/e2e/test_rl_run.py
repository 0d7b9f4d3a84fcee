"""A whole RL run on the real Temporal dev server with real worker, trainer,
engine and router processes (the embedded CPU default)."""

from __future__ import annotations

import asyncio
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from temporalio.client import Client, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from milestone_cli.report import render_report
from tests.stack import Stack, tiny_config
from workers.common import connect
from workflows.config import RunConfig
from workflows.contracts import CONTROL_QUEUE, RunProgress, RunSummary, TrainingRunInput
from workflows.rl_step import RLStep
from workflows.training_run import TrainingRun

pytestmark = pytest.mark.e2e
HISTORY_DIR = Path(__file__).resolve().parents[1] / "histories"
STEP_ACTIVITIES = ["rollout", "compute_rewards", "train_step", "update_weights", "checkpoint"]


async def run_to_end(client: Client, run_id: str, cfg: dict, timeout_s: float = 600) -> RunSummary:
    handle = await client.start_workflow(
        TrainingRun.run, TrainingRunInput(config=RunConfig.model_validate(cfg)), id=run_id, task_queue=CONTROL_QUEUE
    )
    return await asyncio.wait_for(handle.result(), timeout_s)


def activity_names(history: WorkflowHistory) -> list[str]:
    return [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.HasField("activity_task_scheduled_event_attributes")
    ]


def child_ids(history: WorkflowHistory) -> list[str]:
    return [
        e.start_child_workflow_execution_initiated_event_attributes.workflow_id
        for e in history.events
        if e.HasField("start_child_workflow_execution_initiated_event_attributes")
    ]


def test_rl_run_end_to_end(stack: Stack, tmp_path: Path) -> None:
    store = tmp_path / "store"
    cfg = tiny_config(store, steps=3)

    async def main() -> None:
        client = await connect(stack.server.address)
        summary = await run_to_end(client, "e2e-run", cfg)
        assert summary.steps == 3 and summary.policy_version == 3
        assert summary.data_cursor == 3 * cfg["rollout"]["prompts_per_step"]
        assert summary.final_weights_key == "runs/e2e-run/weights/v000003"

        progress = await client.get_workflow_handle("e2e-run").query("progress", result_type=RunProgress)
        assert [s.step for s in progress.steps] == [1, 2, 3]
        for s in progress.steps:
            for value in (s.reward_mean, s.loss, s.kl, s.grad_norm, s.step_seconds, *s.phase_seconds.values()):
                assert math.isfinite(value)
            assert s.grad_norm > 0  # a real optimizer step happened

        # the report CLI renders the curves from the same query
        png = render_report(progress, tmp_path / "report.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

        # one RLStep child per step, each with the five activities in order
        run_history = await client.get_workflow_handle("e2e-run").fetch_history()
        assert child_ids(run_history) == ["e2e-run/step-1", "e2e-run/step-2", "e2e-run/step-3"]
        histories = [run_history]
        for child in child_ids(run_history):
            h = await client.get_workflow_handle(child).fetch_history()
            assert activity_names(h) == STEP_ACTIVITIES
            histories.append(h)

        # replaying the recorded histories against the current workflow code is deterministic
        replayer = Replayer(workflows=[TrainingRun, RLStep], data_converter=pydantic_data_converter)
        for h in histories:
            await replayer.replay_workflow(h)
        if os.environ.get("MILESTONE_RECORD_HISTORY"):  # refresh tests/histories/ after a workflow change
            HISTORY_DIR.mkdir(exist_ok=True)
            (HISTORY_DIR / "training_run.json").write_text(run_history.to_json())
            (HISTORY_DIR / "rl_step.json").write_text(histories[1].to_json())

    asyncio.run(main())

    # the weights changed, and every engine ended on the trainer's final weights
    v0 = load_file(str(store / "runs/e2e-run/weights/v000000/model.safetensors"))
    v3 = load_file(str(store / "runs/e2e-run/weights/v000003/model.safetensors"))
    assert v0.keys() == v3.keys()
    assert any(not torch.equal(v0[k], v3[k]) for k in v0)
    assert all(torch.isfinite(t).all() for t in v3.values())


def test_engine_settings_follow_the_run(stack: Stack, tmp_path: Path) -> None:
    """A later run on the same node agent gets the engine count it asks for."""
    store = tmp_path / "store"

    async def main() -> None:
        client = await connect(stack.server.address)
        await run_to_end(client, "two-engines", tiny_config(store, steps=1))
        await run_to_end(client, "one-engine", tiny_config(store, steps=1, engines={"num_engines": 1}))
        p = await client.get_workflow_handle("one-engine").query("progress", result_type=RunProgress)
        assert [e.slot for e in p.engines] == [0] and p.engines[0].state == "healthy"

    asyncio.run(main())
