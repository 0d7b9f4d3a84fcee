"""SFT mode and on-policy distillation through whole runs on one shared stack (real
Temporal server, workers, trainer, engine and router processes).

The SFT-mode run trains 4 durable steps on dataset rows (no rollout, no reward): its loss
falls, its held-out eval is recorded, each step trained exactly its rows, and its history
replays. Its final weights then serve as the teacher of a 2-step distillation run."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from tests.recorded_histories import record
from tests.e2e.faults import progress, run_to_end
from tests.stack import Stack, tiny_config
from workers.common import connect
from workflows.run_state import RunProgress, RunSummary
from workflows.training_run import RUN_WORKFLOWS

pytestmark = pytest.mark.e2e
SFT_STEPS, ROWS_PER_STEP = 4, 32


@pytest.fixture(scope="module")
def sd_stack(plain_stack: Stack) -> Stack:
    return plain_stack


@pytest.fixture(scope="module")
def store(sd_stack: Stack) -> Path:
    return sd_stack.workdir / "store"


def sft_config(store: Path) -> dict:
    return tiny_config(store, mode="sft", steps=SFT_STEPS, sft={"steps": 0, "batch_size": ROWS_PER_STEP},
                       train={"lr": 3e-3}, checkpoint={"every": 2, "keep_last": 2}, eval={"n": 8, "k": 2},
                       engines={"num_engines": 1})


@pytest.fixture(scope="module")
def sft_run(sd_stack: Stack, store: Path) -> tuple[RunSummary, RunProgress]:
    async def main() -> tuple[RunSummary, RunProgress]:
        client = await connect(sd_stack.server.address)
        summary = await run_to_end(client, "sft", sft_config(store))
        return summary, await progress(client, "sft")

    return asyncio.run(main())


def test_sft_mode_run(sd_stack: Stack, store: Path, sft_run: tuple[RunSummary, RunProgress]) -> None:
    summary, p = sft_run
    assert (summary.steps, summary.policy_version, summary.data_cursor) == (SFT_STEPS, SFT_STEPS, SFT_STEPS * ROWS_PER_STEP)
    losses = [s.loss for s in p.steps]
    assert all(math.isfinite(x) for x in losses) and all(b < a for a, b in zip(losses, losses[1:])), losses
    assert all("rollout" not in s.phase_seconds and s.grad_norm > 0 for s in p.steps)
    assert [s.checkpointed for s in p.steps] == [False, True, False, True]
    # the held-out eval: before the first step (v0) and after the last
    assert summary.eval_before_greedy is not None and summary.eval_step == SFT_STEPS
    assert summary.eval_greedy is not None and 0.0 <= summary.eval_greedy <= 1.0
    print(f"SFT mode: loss per step {[round(x, 3) for x in losses]}; held-out greedy accuracy "
          f"{summary.eval_before_greedy:.3f} -> {summary.eval_greedy:.3f}")

    run = store / "runs" / "sft"
    for step in range(1, SFT_STEPS + 1):  # each step trained exactly its rows, once
        batch = json.loads((run / "steps" / f"{step:06d}" / "step_batch.json").read_text())
        assert batch["sft"] == {"data_cursor": (step - 1) * ROWS_PER_STEP, "n_rows": ROWS_PER_STEP}
        assert batch["chunk_keys"] == [] and not (run / "steps" / f"{step:06d}" / "rollout").exists()

    async def replay() -> None:
        client = await connect(sd_stack.server.address)
        replayer = Replayer(workflows=RUN_WORKFLOWS, data_converter=pydantic_data_converter)
        step = await client.get_workflow_handle("sft/step-2").fetch_history()  # an SFTStep child
        run = await client.get_workflow_handle("sft").fetch_history()
        assert step.events[0].workflow_execution_started_event_attributes.workflow_type.name == "SFTStep"
        await replayer.replay_workflow(step)
        await replayer.replay_workflow(run)
        record("sft_step", step)  # step 2: with its checkpoint (tests/recorded_histories.py)
        record("training_run_sft", run)

    asyncio.run(replay())


def test_distillation_run_from_the_sft_runs_weights(sd_stack: Stack, store: Path,
                                                    sft_run: tuple[RunSummary, RunProgress]) -> None:
    """The SFT-mode run's final version (a plain model folder in the store, same tokenizer:
    the same model.init, data and seed) teaches a student with a short warm-up, for 2 steps."""
    teacher = store / sft_run[0].final_weights_key
    cfg = tiny_config(store, steps=2, sft={"steps": 20}, distill={"teacher_path": str(teacher), "coef": 1.0},
                      checkpoint={"every": 2, "keep_last": 1}, eval={"enabled": False}, engines={"num_engines": 1})

    async def main() -> RunProgress:
        client = await connect(sd_stack.server.address)
        summary = await run_to_end(client, "distill", cfg)
        assert summary.steps == 2 and summary.policy_version == 2
        return await progress(client, "distill")

    p = asyncio.run(main())
    assert all(math.isfinite(s.loss) and s.grad_norm > 0 for s in p.steps)
    kls = []
    for step in (1, 2):
        metrics = json.loads((store / "runs" / "distill" / "steps" / f"{step:06d}" / "train_result.json").read_text())["metrics"]
        assert math.isfinite(metrics["distill_kl"]) and metrics["distill_kl"] > 0, metrics
        kls.append(metrics["distill_kl"])
    assert sd_stack.scrape("node0")['milestone_train{metric="distill_kl"}'] == kls[-1]
    print(f"distillation: reverse KL to the teacher per step {[round(k, 3) for k in kls]}")
