"""``milestone fork`` and ``temporal workflow reset`` on one real stack.

A fork without a change ends bitwise equal to its parent; a fork with another
learning rate equals the parent up to the fork step and differs after; neither
writes into the parent's prefix. A reset of the parent to a step boundary re-runs
the later steps and ends bitwise equal (steps are idempotent). A fork resumed with
``--resume-from`` keeps its lineage and stays bitwise equal to its resumed parent."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from temporalio.api.enums.v1 import EventType

from infra.temporal_server import temporal_binary
from spec.events import Forked, TrainerRestored
from tests.e2e.faults import assert_bitwise_equal, final_weights, progress, run_to_end, trained_samples
from tests.stack import ROOT, Stack, tiny_config
from workers.common import connect

pytestmark = pytest.mark.e2e
STEPS = 3
# checkpoints after SFT (step 0) and at the end only: a fork at step 2 restores step 0 and replays 1-2
CFG = {"steps": STEPS, "checkpoint": {"every": 3, "keep_last": 2}}


@pytest.fixture(scope="module")
def store(stack: Stack) -> Path:
    return stack.workdir / "store"


@pytest.fixture(scope="module")
def parent(stack: Stack, store: Path) -> str:
    async def main() -> None:
        await run_to_end(await connect(stack.server.address), "parent", tiny_config(store, **CFG))

    asyncio.run(main())
    return "parent"


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "milestone_cli.main", "--address", stack.server.address, *args],
        capture_output=True, text=True, cwd=ROOT, timeout=400,
    )


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def weights(store: Path, run_id: str, version: int) -> dict[str, torch.Tensor]:
    return final_weights(store, run_id, version)


def test_fork_equals_parent_without_change_and_differs_after_with_one(stack: Stack, store: Path, parent: str) -> None:
    before = tree(store / "runs" / parent)

    out = cli(stack, "fork", parent, "--from-step", "2", "--run-id", "fork-same", "--wait")
    assert out.returncode == 0, out.stderr
    assert "forked parent at step 2 as fork-same" in out.stdout
    out = cli(stack, "fork", parent, "--from-step", "2", "--run-id", "fork-lr", "--set", "lr=1e-3", "--wait")
    assert out.returncode == 0, out.stderr

    async def main() -> None:
        client = await connect(stack.server.address)
        p = await progress(client, "fork-same")
        assert [s.step for s in p.steps] == [3] and p.policy_version == STEPS
        assert [(a.run_id, a.step) for a in p.lineage] == [(parent, 2)]
        restored = [(e.restored_from_step, e.replayed_steps, e.version) for e in p.events
                    if isinstance(e, TrainerRestored)]
        assert restored == [(0, [1, 2], 2)], [e.kind for e in p.events]
        assert [(e.parent, e.step) for e in p.events if isinstance(e, Forked)] == [(parent, 2)]
        assert p.data_cursor == (await progress(client, parent)).data_cursor

    asyncio.run(main())
    status = cli(stack, "status", "fork-same")
    assert status.returncode == 0 and f"forked from {parent} at step 2" in status.stdout, status.stdout

    # no change: bitwise the parent; lr changed after step 2: the parent's v2 (the store holds no copy
    # of v2, a version between checkpoints: its step-3 rollout, the same prompts and seeds on the
    # rebuilt v2, has the parent's tokens and logprobs), then other weights
    assert_bitwise_equal(weights(store, "fork-same", STEPS), weights(store, parent, STEPS))
    assert not (store / "runs" / parent / "weights" / "v000002").exists()
    rolled = [[(s["response_ids"], s["logprobs"]) for s in trained_samples(store, r, 3)] for r in ("fork-lr", parent)]
    assert rolled[0] == rolled[1]
    lr3, p3 = weights(store, "fork-lr", STEPS), weights(store, parent, STEPS)
    assert any(not torch.equal(lr3[k], p3[k]) for k in p3)
    # the parent's artifacts were only read
    assert tree(store / "runs" / parent) == before
    assert not (store / "runs" / "fork-same" / "steps" / "000002").exists()

    # refused before anything starts: a taken id, a step the parent never committed
    out = cli(stack, "fork", parent, "--from-step", "2", "--run-id", "fork-same")
    assert out.returncode == 2 and "is taken" in out.stderr
    out = cli(stack, "fork", parent, "--from-step", "4", "--run-id", "fork-late")
    assert out.returncode == 2 and "committed steps up to 3" in out.stderr


def step_boundary(events: list, child_id: str) -> int:
    """The WorkflowTaskCompleted that follows the completion of the step child ``child_id``:
    resetting there re-runs everything after that step."""
    done = next(
        i for i, e in enumerate(events)
        if e.event_type == EventType.EVENT_TYPE_CHILD_WORKFLOW_EXECUTION_COMPLETED
        and e.child_workflow_execution_completed_event_attributes.workflow_execution.workflow_id == child_id
    )
    return next(e.event_id for e in events[done:] if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED)


def test_temporal_reset_to_a_step_boundary_reruns_the_later_steps(stack: Stack, store: Path, parent: str) -> None:
    final = weights(store, parent, STEPS)

    async def main() -> None:
        client = await connect(stack.server.address)
        handle = client.get_workflow_handle(parent)
        history = await handle.fetch_history()
        event_id = step_boundary(list(history.events), f"{parent}/step-1")
        out = subprocess.run(
            [temporal_binary(), "workflow", "reset", "--address", stack.server.address, "--workflow-id", parent,
             "--event-id", str(event_id), "--reason", "redo steps 2-3"],
            capture_output=True, text=True, timeout=60,
        )
        assert out.returncode == 0, out.stderr
        summary = await asyncio.wait_for(client.get_workflow_handle(parent).result(), 300)
        assert summary["steps"] == STEPS
        p = await progress(client, parent)
        assert [s.step for s in p.steps] == [1, 2, 3]
        assert p.steps[1].chunks_reused > 0  # the rollout of step 2 came from the store

    asyncio.run(main())
    assert_bitwise_equal(weights(store, parent, STEPS), final)


def test_a_resumed_fork_keeps_its_lineage(stack: Stack, store: Path, parent: str, tmp_path: Path) -> None:
    """The fork's dataset and steps up to 2 are the parent's: a resume that forgot the
    lineage failed on the dataset (``runs/fork-same/data/train.jsonl`` is missing)."""
    assert (store / "runs" / "fork-same").exists(), "the first test of this module makes the fork"
    longer = tmp_path / "longer.yaml"
    longer.write_text(yaml.safe_dump(tiny_config(store, **{**CFG, "steps": STEPS + 1})))
    for run_id in (parent, "fork-same"):
        out = cli(stack, "start", str(longer), "--resume-from", run_id, "--wait")
        assert out.returncode == 0, out.stderr
        assert f"resuming {run_id} at step {STEPS + 1}" in out.stdout
    assert f"a fork of {parent} at step 2" in out.stdout

    async def main() -> None:
        p = await progress(await connect(stack.server.address), "fork-same")
        assert [s.step for s in p.steps] == [STEPS + 1] and p.policy_version == STEPS + 1
        assert [(a.run_id, a.step) for a in p.lineage] == [(parent, 2)]

    asyncio.run(main())
    assert_bitwise_equal(weights(store, "fork-same", STEPS + 1), weights(store, parent, STEPS + 1))
    assert not (store / "runs" / "fork-same" / "data").exists()  # still read from the parent
