"""Process faults during a real run (DESIGN §7): trainer crash, orchestration worker
crash, Temporal server restart, node agent loss. Each run must complete, train every
step exactly once on exactly its prompts, and end bitwise equal to the fault-free run."""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gpu_runtime.proc.processes import pid_alive
from spec.events import CheckpointCorrupt, DiskFull, TrainerRestarted, TrainerRestored
from tests.e2e.faults import (
    Baselines, assert_bitwise_equal, assert_trained_exactly_once, final_weights, kill_trainer, module_stack_fixtures,
    progress, restart_control, restart_server, run_with_fault, start_run, wait_activity_started,
)
from tests.stack import Stack, async_wait_for, running_stack, tiny_config, wait_for
from workers.common import connect
from workflows.run_state import RunProgress
from workflows.stubs import CHECKPOINT, TRAIN_STEP

pytestmark = pytest.mark.e2e
STEPS = 3
# checkpoints only at the end: a rebuilt trainer must restore step 0 and replay
CFG = {"steps": STEPS, "checkpoint": {"every": 3, "keep_last": 2}}
# a checkpoint 2's background write waits while this file is missing (it exists but in the upload-crash row)
UPLOAD_GATE = Path(tempfile.gettempdir()) / f"milestone-upload-gate-{os.getpid()}"
# while this file exists, the checkpoint of the last step fails with a real OSError(ENOSPC)
ENOSPC_GATE = Path(tempfile.gettempdir()) / f"milestone-enospc-gate-{uuid.uuid4().hex[:8]}"
# fault-injection aids: each train step and checkpoint waits first, so a kill lands inside it
ENV = {"MILESTONE_FAULT_TRAIN_DELAY_S": "2", "MILESTONE_FAULT_CHECKPOINT_DELAY_S": "1.5",
       "MILESTONE_FAULT_UPLOAD_GATE": f"2:{UPLOAD_GATE}", "MILESTONE_FAULT_ENOSPC": f"checkpoint:{STEPS}:{ENOSPC_GATE}"}

stack, store = module_stack_fixtures("process-faults", ENV)


@pytest.fixture(scope="module", autouse=True)
def upload_gate() -> Iterator[Path]:
    UPLOAD_GATE.touch()
    yield UPLOAD_GATE
    UPLOAD_GATE.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def baseline(baselines: Baselines, store: Path) -> dict:
    return baselines.weights(tiny_config(store, **CFG))


def test_trainer_killed_mid_train_step(stack: Stack, store: Path, baseline: dict) -> None:
    cfg = tiny_config(store, **CFG)
    _, p, old = run_with_fault(stack, "trainer-crash", cfg, (2, TRAIN_STEP), kill_trainer)
    step2 = p.steps[1]
    assert step2.restored_from_step == 0 and step2.replayed_steps == [1]
    assert stack.node_pids("node0")["trainer"] != old
    kinds = [e.kind for e in p.events]
    assert "trainer_restarted" in kinds and "trainer_restored" in kinds, kinds
    assert_trained_exactly_once(store, "trainer-crash", cfg)
    assert_bitwise_equal(final_weights(store, "trainer-crash", STEPS), baseline)


# the same run with bf16 autocast forwards (train.precision): its twin must end bitwise too
CFG_BF16 = {**CFG, "train": {"lr": 1e-4, "precision": "bf16"}}


def test_bf16_trainer_killed_mid_train_step(stack: Stack, store: Path, baseline: dict, baselines: Baselines) -> None:
    """The trainer-crash row with ``train.precision: bf16``: the restarted trainer restores
    step 0 and replays step 1 in bf16 (each step stores its precision), and the run ends
    bitwise equal to the fault-free bf16 run, which differs from the float32 one (the knob
    reached the trainer process)."""
    bf16_baseline = baselines.weights(tiny_config(store, **CFG_BF16))
    assert any(not torch.equal(bf16_baseline[k], baseline[k]) for k in baseline), "bf16 trained like float32"
    run_id = "trainer-crash-bf16"
    _, p, _ = run_with_fault(stack, run_id, tiny_config(store, **CFG_BF16), (2, TRAIN_STEP), kill_trainer)
    assert p.steps[1].restored_from_step == 0 and p.steps[1].replayed_steps == [1]
    batch = json.loads((store / "runs" / run_id / "steps" / "000001" / "step_batch.json").read_text())
    assert batch["hparams"]["precision"] == "bf16"
    assert_bitwise_equal(final_weights(store, run_id, STEPS), bf16_baseline)


def test_trainer_killed_during_checkpoint_is_an_event(stack: Stack, store: Path, baseline: dict) -> None:
    """A trainer restart outside train_step: the checkpoint activity restores and
    replays, and the run's events name the checkpoint and the replayed steps."""
    run_id = "trainer-crash-ckpt"
    _, p, old = run_with_fault(stack, run_id, tiny_config(store, **CFG), (STEPS, CHECKPOINT), kill_trainer)
    restarted = [e for e in p.events if isinstance(e, TrainerRestarted)]
    restored = [e for e in p.events if isinstance(e, TrainerRestored)]
    assert restarted and restarted[0].old_pid == old, [e.kind for e in p.events]
    assert restored and (restored[0].restored_from_step, restored[0].replayed_steps, restored[0].version) == (
        0, [1, 2, 3], STEPS)
    assert p.steps[-1].checkpointed
    assert_bitwise_equal(final_weights(store, run_id, STEPS), baseline)


def test_disk_full_during_checkpoint_waits_then_completes(stack: Stack, store: Path, baseline: dict) -> None:
    """The last checkpoint's write fails with ENOSPC while the gate file exists: the run
    says what is full (a ``disk_full`` event: the path and its free bytes) and waits,
    running; once the gate is gone (space is back) the checkpoint is called again and the
    run completes, bitwise equal to its twin."""
    run_id = "disk-full"
    ENOSPC_GATE.touch()
    try:
        async def full_disk() -> RunProgress:
            client = await connect(stack.server.address)
            await start_run(client, run_id, tiny_config(store, **CFG))

            async def reported() -> RunProgress | None:
                p = await progress(client, run_id)
                return p if any(e.kind == "disk_full" for e in p.events) else None

            return await async_wait_for(reported, 300, interval_s=1.0, what="a disk_full event")

        waiting = asyncio.run(full_disk())
    finally:
        ENOSPC_GATE.unlink(missing_ok=True)
    event = next(e for e in waiting.events if isinstance(e, DiskFull) and e.node)  # the node agent's: the run waits
    assert waiting.state == "running", waiting.state
    assert event.what == f"checkpoint {STEPS}" and "bytes free" in event.error, event
    assert "No space left on device" in event.error, event

    async def space_back() -> tuple[RunProgress, list[str]]:
        client = await connect(stack.server.address)
        await asyncio.wait_for(client.get_workflow_handle(run_id).result(), 300)
        history = await client.get_workflow_handle(f"{run_id}/step-{STEPS}").fetch_history()
        scheduled = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                     if e.HasField("activity_task_scheduled_event_attributes")]
        return await progress(client, run_id), scheduled

    done, scheduled = asyncio.run(space_back())
    assert done.state == "completed" and done.steps[-1].checkpointed
    assert scheduled.count(CHECKPOINT.name) >= 2 and scheduled.count(TRAIN_STEP.name) == 1, scheduled
    assert_trained_exactly_once(store, run_id, tiny_config(store, **CFG))
    assert_bitwise_equal(final_weights(store, run_id, STEPS), baseline)


def test_control_worker_killed_mid_run(stack: Stack, store: Path, baseline: dict) -> None:
    cfg = tiny_config(store, **CFG)
    summary, _, _ = run_with_fault(stack, "control-crash", cfg, (2, TRAIN_STEP), restart_control)
    assert summary.steps == STEPS and summary.data_cursor == STEPS * 4
    assert_trained_exactly_once(store, "control-crash", cfg)
    assert_bitwise_equal(final_weights(store, "control-crash", STEPS), baseline)


def test_temporal_server_restarted_mid_run(stack: Stack, store: Path, baseline: dict) -> None:
    cfg = tiny_config(store, **CFG)
    summary, _, _ = run_with_fault(stack, "server-restart", cfg, (2, TRAIN_STEP), restart_server)
    assert summary.steps == STEPS
    assert_trained_exactly_once(store, "server-restart", cfg)
    assert_bitwise_equal(final_weights(store, "server-restart", STEPS), baseline)


def test_node_agent_killed_run_moves_to_spare(tmp_path: Path, baseline: dict) -> None:
    store = tmp_path / "store"
    with running_stack(tmp_path, env=ENV, gpu_nodes=("node0", "node1")) as stack:

        async def main() -> None:
            client = await connect(stack.server.address)
            handle = await start_run(client, "node-loss", tiny_config(store, **CFG))
            await wait_activity_started(client, "node-loss/step-2", TRAIN_STEP.name)
            lost = (await progress(client, "node-loss")).node_queue
            assert lost is not None
            node_id = lost.split("-")[1]
            children = stack.node_children(node_id)
            stack.kill(f"gpu-{node_id}")
            await asyncio.wait_for(handle.result(), 300)
            p = await progress(client, "node-loss")
            assert p.node_queue != lost
            assert any(e.kind == "node_lost" for e in p.events)

            # the dead agent's trainer, engines and router exit on their own (parent watch)
            def alive() -> list[str]:
                return [Path(f"/proc/{c}/cmdline").read_text().replace("\0", " ")[:80] for c in children if pid_alive(c)]

            try:
                wait_for(lambda: not alive(), 30, what="orphans to exit")
            except TimeoutError as err:
                raise AssertionError(f"still alive: {alive()}") from err

        asyncio.run(main())
    assert_trained_exactly_once(store, "node-loss", tiny_config(store, **CFG))
    # the spare rebuilt v1 (checkpoint 0 + replay) for its engines: the store never held a copy of it
    assert sorted(d.name for d in (store / "runs" / "node-loss" / "weights").iterdir()) == ["v000000", "v000003"]
    assert_bitwise_equal(final_weights(store, "node-loss", STEPS), baseline)


def test_corrupt_checkpoint_is_reported_and_previous_used(stack: Stack, store: Path, baseline: dict) -> None:
    run_id = "corrupt-ckpt"
    cfg = tiny_config(store, steps=STEPS, checkpoint={"every": 1, "keep_last": 3})

    def corrupt_checkpoint_2_and_kill_trainer(stack: Stack) -> None:
        ckpt2 = store / "runs" / run_id / "checkpoints" / "step-000002"
        wait_for(lambda: (ckpt2 / "manifest.json").exists(), 60, what="checkpoint 2 durable")
        blob = ckpt2 / "policy.safetensors"
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF  # flip one byte in the stored checkpoint
        blob.write_bytes(bytes(data))
        # the node's disk copies go too, so the store is the only source
        for local in (stack.workdir / "nodes" / "node0" / "trainer" / run_id / "checkpoints").glob("step-*"):
            for f in local.iterdir():
                f.unlink()
            local.rmdir()
        kill_trainer(stack)

    _, p, _ = run_with_fault(stack, run_id, cfg, (3, TRAIN_STEP), corrupt_checkpoint_2_and_kill_trainer)
    corrupt = [e for e in p.events if isinstance(e, CheckpointCorrupt)]
    assert corrupt and corrupt[0].step == 2, ([e.kind for e in p.events], p.steps[2])
    assert p.steps[2].restored_from_step == 1 and p.steps[2].replayed_steps == [2]
    assert_bitwise_equal(final_weights(store, run_id, STEPS), baseline)


def test_trainer_killed_while_a_checkpoint_uploads(stack: Stack, store: Path, baseline: dict) -> None:
    """Checkpoint 2 is a snapshot the run goes on from while its files are written (held back
    here); the trainer dies before they exist, in step 3's train step. The restarted trainer
    restores checkpoint 1, the last durable one, and replays step 2; checkpoint 2 never
    becomes durable, and the run ends bitwise equal to its twin."""
    run_id = "crash-mid-upload"
    cfg = tiny_config(store, steps=STEPS, checkpoint={"every": 1, "keep_last": 3})

    def kill_trainer_then_let_writes_go(stack: Stack) -> None:
        kill_trainer(stack)
        UPLOAD_GATE.touch()

    UPLOAD_GATE.unlink()
    try:
        _, p, _ = run_with_fault(stack, run_id, cfg, (3, TRAIN_STEP), kill_trainer_then_let_writes_go)
    finally:
        UPLOAD_GATE.touch()
    assert p.steps[1].checkpointed  # the step's checkpoint call returned: the write was left to the upload thread
    assert p.steps[2].restored_from_step == 1 and p.steps[2].replayed_steps == [2], p.steps[2]
    checkpoints = store / "runs" / run_id / "checkpoints"
    assert sorted(m.parent.name for m in checkpoints.glob("*/manifest.json"))[-2:] == ["step-000001", "step-000003"]
    assert_trained_exactly_once(store, run_id, cfg)
    assert_bitwise_equal(final_weights(store, run_id, STEPS), baseline)
