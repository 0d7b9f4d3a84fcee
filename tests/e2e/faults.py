"""Helpers for fault-injection tests: start runs, wait for a phase, compare weights."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import torch
from safetensors.torch import load_file
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from gpu_runtime.data.datasets import prompts_for_step
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


def trained_exactly_once(store: Path, run_id: str, cfg: dict) -> None:
    """Each step of the run (``cfg``) trained exactly its prompts (seed, cursor), each once, in order."""
    p, g = cfg["rollout"]["prompts_per_step"], cfg["rollout"]["group_size"]
    n_rows, steps = cfg["data"]["num_train"], cfg["steps"]
    run_dir = store / "runs" / run_id
    # the steps that trained (steps/000000 holds only the eval of the post-SFT policy)
    trained_steps = sorted(d.name for d in (run_dir / "steps").iterdir() if (d / "step_batch.json").exists())
    assert trained_steps == [f"{s:06d}" for s in range(1, steps + 1)]
    for step in range(1, steps + 1):
        spec = json.loads((run_dir / "steps" / f"{step:06d}" / "step_batch.json").read_text())
        trained = []
        for key in spec["chunk_keys"]:
            trained += [s["prompt_index"] for s in json.loads((store / key).read_text())["samples"]]
        expected = prompts_for_step(n_rows, cfg["seed"], (step - 1) * p, p)
        assert trained == [i for i in expected for _ in range(g)], f"step {step}"


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


def config_key(cfg: dict) -> str:
    """A run config as JSON, defaults filled in, less its store: two configs with one key train
    the same weights bitwise, whatever the store, run id, stack or fault-injection delays."""
    return json.dumps(RunConfig.model_validate(cfg).model_dump(mode="json", exclude={"store"}), sort_keys=True)


class Baselines:
    """The fault-free runs every faulted run is compared with, one per distinct config
    (``config_key``) per session, on the session's plain stack (no fault-injection delays:
    they change only how long a run takes). Modules whose faulted runs share a config share
    its baseline; a module that reads the baseline run's own history or artifacts runs it
    on its own stack instead (``module_baseline_fixture``)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.store = stack.workdir / "store"
        self._weights: dict[str, dict[str, torch.Tensor]] = {}

    def weights(self, cfg: dict) -> dict[str, torch.Tensor]:
        """The final weights of the fault-free run of ``cfg`` (run on first use)."""
        key = config_key(cfg)
        if key not in self._weights:
            run_id = f"baseline-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
            self._weights[key] = baseline_weights(self.stack, self.store, {**cfg, "store": f"file://{self.store}"}, run_id)
        return self._weights[key]


def module_stack_fixtures(name: str, env: dict[str, str]) -> tuple:
    """The module-scoped ``stack`` and ``store`` fixtures of a fault-injection module whose
    agents need ``env`` (its own stack). Use as ``stack, store = module_stack_fixtures("name", ENV)``."""

    @pytest.fixture(scope="module")
    def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
        with running_stack(tmp_path_factory.mktemp(name), env=env) as s:
            yield s

    @pytest.fixture(scope="module")
    def store(stack: Stack) -> Path:
        return stack.workdir / "store"

    return stack, store


def module_baseline_fixture(config: Callable[[Path], dict]) -> Callable:
    """The module-scoped ``baseline`` fixture of a module that reads the fault-free run's own
    progress and artifacts: ``config(store)`` run as ``baseline`` on the module's stack; its
    final weights. (A module that needs only the weights takes ``baselines.weights(cfg)``.)"""

    @pytest.fixture(scope="module")
    def baseline(stack: Stack, store: Path) -> dict[str, torch.Tensor]:
        return baseline_weights(stack, store, config(store))

    return baseline
