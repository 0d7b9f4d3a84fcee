"""Helpers for fault-injection tests: start runs, inject a fault at a phase, check what
each step trained, compare weights."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import pytest

import torch
from safetensors.torch import load_file
from temporalio.api.enums.v1 import RetryState, TimeoutType
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from gpu_runtime.data.datasets import prompts_for_step
from spec.run import RunConfig
from tests.stack import Stack, async_wait_for, running_stack
from workers.common import connect
from workflows.run_state import RunProgress, RunSummary, TrainingRunInput
from workflows.queues import CONTROL_QUEUE
from workflows.stubs import ActivityStub
from workflows.training_run import TrainingRun

STARTED = 2  # PendingActivityState.PENDING_ACTIVITY_STATE_STARTED
T = TypeVar("T")


async def start_run(client: Client, run_id: str, cfg: dict) -> WorkflowHandle:
    return await client.start_workflow(
        TrainingRun.run, TrainingRunInput(config=RunConfig.model_validate(cfg)), id=run_id,
        task_queue=CONTROL_QUEUE, result_type=RunSummary,
    )


async def run_to_end(client: Client, run_id: str, cfg: dict, timeout_s: float = 300) -> RunSummary:
    handle = await start_run(client, run_id, cfg)
    return await asyncio.wait_for(run_result(handle), timeout_s)


async def run_result(handle: WorkflowHandle, retries: int = 20) -> RunSummary:
    """The run's result. ``handle.result()`` long-polls the history; when one poll fails the SDK raises
    (seen in 10-13 minute runs on a loaded 2-core machine: the server's DEADLINE_EXCEEDED, the client's
    CANCELLED "Timeout expired", an "http2 error" on the connection), though the run goes on
    untouched. Poll again while the server still describes the run; give up after ``retries``."""
    for _ in range(retries):
        try:
            return await handle.result()
        except RPCError:
            await asyncio.sleep(1.0)
            await handle.describe()  # the server answers and the run exists: the poll, not the run, failed
    return await handle.result()


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


@dataclass(frozen=True)
class TimedOut:
    """An activity that timed out, as its workflow's history records it (times are HH:MM:SS.mmm)."""

    workflow: str
    activity: str
    queue: str
    timeout: str  # TIMEOUT_TYPE_HEARTBEAT, TIMEOUT_TYPE_SCHEDULE_TO_START, ...
    retry_state: str  # RETRY_STATE_NON_RETRYABLE_FAILURE, RETRY_STATE_IN_PROGRESS, ...
    scheduled: str
    started: str  # "never": it timed out before a worker took it
    at: str

    def __str__(self) -> str:
        return (f"{self.workflow}: {self.activity} on {self.queue} {self.timeout}: scheduled {self.scheduled}, "
                f"started {self.started}, timed out {self.at}")


async def timed_out_activities(client: Client, workflow_id: str) -> list[TimedOut]:
    """Each activity of ``workflow_id`` and of its child workflows (a run's steps) that timed out,
    read from their histories. What a "no node lost in a fault-free run" assertion prints: a false
    positive of the liveness timeouts is then one of these, not a guess."""
    out: list[TimedOut] = []
    pending = [workflow_id]
    while pending:
        wf = pending.pop(0)
        scheduled: dict[int, tuple[str, str, str]] = {}
        started: dict[int, str] = {}
        async for ev in client.get_workflow_handle(wf).fetch_history_events():
            at = ev.event_time.ToDatetime().strftime("%H:%M:%S.%f")[:-3]
            if ev.HasField("activity_task_scheduled_event_attributes"):
                a = ev.activity_task_scheduled_event_attributes
                scheduled[ev.event_id] = (a.activity_type.name, a.task_queue.name, at)
            elif ev.HasField("activity_task_started_event_attributes"):
                started[ev.activity_task_started_event_attributes.scheduled_event_id] = at
            elif ev.HasField("activity_task_timed_out_event_attributes"):
                t = ev.activity_task_timed_out_event_attributes
                name, queue, sched = scheduled.get(t.scheduled_event_id, ("?", "?", "?"))
                out.append(TimedOut(wf, name, queue, TimeoutType.Name(t.failure.timeout_failure_info.timeout_type),
                                    RetryState.Name(t.retry_state), sched,
                                    started.get(t.scheduled_event_id, "never"), at))
            elif ev.HasField("child_workflow_execution_started_event_attributes"):
                pending.append(ev.child_workflow_execution_started_event_attributes.workflow_execution.workflow_id)
    return out


async def assert_no_node_lost(client: Client, run_id: str) -> None:
    """A fault-free run lost no node: no false positive of the liveness timeouts on this loaded
    machine. When it did, the message names the timeouts from the histories."""
    lost = [e for e in (await progress(client, run_id)).events if e.kind == "node_lost"]
    if lost:
        timed_out = "; ".join(str(t) for t in await timed_out_activities(client, run_id))
        raise AssertionError(f"a fault-free run lost a node: {lost}; timed out: {timed_out or 'none'}")


async def progress(client: Client, run_id: str) -> RunProgress:
    return await client.get_workflow_handle(run_id).query(TrainingRun.progress)


def run_progress(stack: Stack, run_id: str) -> RunProgress:
    """``progress`` of ``run_id`` on ``stack``, from outside an event loop."""

    async def main() -> RunProgress:
        return await progress(await connect(stack.server.address), run_id)

    return asyncio.run(main())


def run_with_fault(
    stack: Stack, run_id: str, cfg: dict, at: tuple[int, ActivityStub], fault: Callable[[Stack], T]
) -> tuple[RunSummary, RunProgress, T]:
    """Start ``cfg`` as ``run_id``; once the ``at`` = (step, activity) is picked up by a
    worker, ``fault(stack)``; wait (300 s) for the run to end. Its summary, its progress
    and what ``fault`` returned."""
    step, stub = at

    async def main() -> tuple[RunSummary, RunProgress, T]:
        client = await connect(stack.server.address)
        await start_run(client, run_id, cfg)
        await wait_activity_started(client, f"{run_id}/step-{step}", stub.name)
        done = fault(stack)
        client = await connect(stack.server.address)  # a new client: the fault may have restarted the server
        summary = await asyncio.wait_for(run_result(client.get_workflow_handle(run_id, result_type=RunSummary)), 300)
        return summary, await progress(client, run_id), done

    return asyncio.run(main())


def kill_trainer(stack: Stack) -> int:
    """SIGKILL node0's trainer process; its pid."""
    pid = stack.node_pids("node0")["trainer"]
    os.kill(pid, signal.SIGKILL)
    return pid


def kill_engines(stack: Stack, slots: list[int]) -> list[int]:
    """SIGKILL node0's engines in ``slots``; the pids of all its engines (before the kill)."""
    engines = stack.node_pids("node0")["engines"]
    for slot in slots:
        os.kill(engines[slot], signal.SIGKILL)
    return engines


def restart_control(stack: Stack) -> None:
    """SIGKILL the control worker and start a new one."""
    stack.kill("control")
    stack.start_control()


def restart_server(stack: Stack) -> None:
    stack.server.restart()  # same port, same SQLite file


def trained_samples(store: Path, run_id: str, step: int) -> list[dict]:
    """The samples step ``step`` of ``run_id`` trained on (its stored batch's chunks), in order."""
    batch = json.loads((store / "runs" / run_id / "steps" / f"{step:06d}" / "step_batch.json").read_text())
    return [s for key in batch["chunk_keys"] for s in json.loads((store / key).read_text())["samples"]]


def assert_trained_exactly_once(store: Path, run_id: str, cfg: dict, versions: list[set[int]] | None = None) -> None:
    """Each of the run's ``cfg["steps"]`` steps trained exactly its prompts (seed, cursor),
    each once, in order; with ``versions``, on samples the engines stamped with the weight
    versions ``versions[step - 1]``."""
    steps, p, g = cfg["steps"], cfg["rollout"]["prompts_per_step"], cfg["rollout"]["group_size"]
    run_dir = store / "runs" / run_id
    # the steps that trained (steps/000000 holds only the eval of the post-SFT policy)
    trained_steps = sorted(d.name for d in (run_dir / "steps").iterdir() if (d / "step_batch.json").exists())
    assert trained_steps == [f"{s:06d}" for s in range(1, steps + 1)]
    for step in range(1, steps + 1):
        samples = trained_samples(store, run_id, step)
        expected = prompts_for_step(cfg["data"]["num_train"], cfg["seed"], (step - 1) * p, p)
        assert [s["prompt_index"] for s in samples] == [i for i in expected for _ in range(g)], f"step {step}"
        if versions is not None:
            assert {s["weight_version"] for s in samples} == versions[step - 1], f"step {step}"


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
        await assert_no_node_lost(client, run_id)
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


def module_stack_fixtures(name: str, env: dict[str, str], gpu_nodes: tuple[str, ...] = ("node0",)) -> tuple:
    """The module-scoped ``stack`` and ``store`` fixtures of a fault-injection module whose
    agents need ``env`` (or more nodes than node0): its own stack. Use as
    ``stack, store = module_stack_fixtures("name", ENV)``."""

    @pytest.fixture(scope="module")
    def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
        with running_stack(tmp_path_factory.mktemp(name), env=env, gpu_nodes=gpu_nodes) as s:
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


def rollout_samples(store: Path, run_id: str, step: int) -> list[dict]:
    """Step ``step``'s rollout samples as stored, in chunk order (JSON, as a test compares them)."""
    out = []
    for chunk in sorted((store / "runs" / run_id / "steps" / f"{step:06d}" / "rollout").glob("chunk-*.json")):
        out += json.loads(chunk.read_text())["samples"]
    return out
