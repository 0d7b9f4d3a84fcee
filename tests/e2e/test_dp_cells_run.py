"""trainer.cells: 2 through the real stack: the node's trainer process drives two DP cell
processes joined by a real torchft lighthouse. Cell 1 is SIGKILLed inside step 2 (while it
waits before its allreduce): step 2 commits with cell 0 alone, the run restarts cell 1 on
its backoff schedule (the ``restart_cells`` activity of a later step starts it in the
background: no step waits for it), cell 1 copies its state from cell 0 in the first step's
quorum after it is up, and from then on the two cells are bitwise equal
(the group compares their weight + AdamW checksums after every step).

The fault-free twin (same config, two cells throughout) is the reference. Step 2 differs
from the twin's only in the order of the gradient's float sums (one cell adds all
micro-batches; two cells add two partial sums), ~1e-7 relative; later steps carry that
through AdamW. The bound is the one tests/unit/test_trainer_cell.py justifies for the
same kind of reordering (1e-5 absolute on weights that move ~1e-3 per step), and losses
agree to 1e-4 relative. The histories of the faulted run replay on the current code.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torchft  # noqa: F401  (a dev dependency: imported, so a broken install fails loudly)

from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from gpu_runtime.proc.processes import pid_alive
from spec.event_text import event_text
from spec.events import CellLost
from tests.e2e.faults import final_weights, progress, run_to_end, start_run, wait_activity_started
from tests.stack import Stack, async_wait_for, running_stack, tiny_config
from workers.common import connect
from workflows.run_state import RunProgress
from workflows.stubs import TRAIN_STEP
from workflows.training_run import RUN_WORKFLOWS

pytestmark = pytest.mark.e2e
STEPS = 10  # a restarted cell is built in the background (~4.5 s here) while steps go on with one cell
HOLD = 8  # cell 0 waits before the quorum of v8 until the restarted cell 1 is built (GATE): steps 8..10 run on two
WEIGHT_ATOL = 1e-5
# cell 1 waits 2 s before step 2's allreduce (a kill lands mid-step); cell 0 waits before step
# HOLD's quorum until the test creates the gate: however long the background restart takes under
# CI load, the heal lands before the run ends
ENV = {"MILESTONE_FAULT_CELL_DELAY": f"1:2:2,0:600:{HOLD}:quorum"}
GATE = "cell_gate"  # under the stack's work dir: every fault delay ends once it exists


def cfg(store: Path) -> dict:
    return tiny_config(store, steps=STEPS, sft={"steps": 20}, train={"lr": 1e-3, "micro_batch_size": 4, "entropy_coef": 0.01},
                       checkpoint={"every": 5, "keep_last": 2}, eval={"enabled": False}, engines={"num_engines": 1},
                       trainer={"cells": 2, "cell_restart_backoff_s": 1, "collective_timeout_s": 20})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("dp")
    with running_stack(work, env={**ENV, "MILESTONE_FAULT_CELL_GATE": str(work / GATE)}) as s:
        yield s


@pytest.fixture(scope="module")
def runs(stack: Stack) -> tuple[RunProgress, RunProgress, int]:
    store = stack.workdir / "store"

    async def main() -> tuple[RunProgress, RunProgress, int]:
        client = await connect(stack.server.address)
        handle = await start_run(client, "faulted", cfg(store))
        await wait_activity_started(client, "faulted/step-2", TRAIN_STEP.name)
        log = next(iter(stack.workdir.rglob("faulted/dp/cell1.log")))
        await async_wait_for(lambda: _has(log, "fault delay before the allreduce of v2"), 60,
                             what="cell 1 inside step 2")
        victim = (await progress(client, "faulted")).dp.cells[1].pid
        os.kill(victim, signal.SIGKILL)
        await async_wait_for(lambda: _seen_times(log, "cell 1 built", 2), 600, what="cell 1 restarted and built")
        (stack.workdir / GATE).touch()  # cell 0 goes on with step 20 (and the twin runs without delays)
        summary = await asyncio.wait_for(handle.result(), 600)
        assert summary.policy_version == STEPS
        twin = await run_to_end(client, "twin", cfg(store), timeout_s=600)
        assert twin.policy_version == STEPS
        replayer = Replayer(workflows=RUN_WORKFLOWS, data_converter=pydantic_data_converter)
        await replayer.replay_workflow(await handle.fetch_history())
        for step in range(2, STEPS + 1):
            await replayer.replay_workflow(await client.get_workflow_handle(f"faulted/step-{step}").fetch_history())
        return await progress(client, "twin"), await progress(client, "faulted"), victim

    return asyncio.run(main())


async def _has(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text(errors="replace")


async def _seen_times(path: Path, text: str, n: int) -> bool:
    return path.exists() and path.read_text(errors="replace").count(text) >= n


def test_a_killed_cell_costs_its_step_nothing_and_is_healed_from_its_peer(stack: Stack, runs) -> None:
    twin, faulted, victim = runs
    assert not pid_alive(victim)
    kinds = [e.kind for e in faulted.events]
    for kind in ("cell_lost", "cell_restarted", "cell_healed"):
        assert kind in kinds, (kind, faulted.events)
    assert "cells_diverged" not in kinds and "trainer_restored" not in kinds  # no restore + replay: a shrink
    lost = next(e for e in faulted.events if isinstance(e, CellLost))
    assert lost.cell == 1 and lost.pid == victim and "died" in lost.why
    assert not any(s.replayed_steps for s in faulted.steps)  # the survivor kept its state
    dp = faulted.dp
    assert dp is not None and [c.state for c in dp.cells] == ["alive", "alive"]
    assert dp.cells[1].restarts == 1 and dp.cells[1].pid != victim and dp.cells[1].healed_from_step is not None
    assert dp.cells[0].state_checksum == dp.cells[1].state_checksum  # the healed cell is bitwise its peer
    assert dp.cells[0].policy_version == dp.cells[1].policy_version == STEPS
    assert faulted.cell_heal == {}  # nothing left to restart
    restarts = [s for s in faulted.steps if s.cell_restarts]
    assert [s.dp_cells for s in twin.steps] == [2] * STEPS
    assert faulted.steps[1].dp_cells == 1  # step 2 committed by the survivor alone
    assert faulted.steps[1].grad_norm > 0  # the entropy bonus: the shrink step moves the weights whatever the rewards
    for s in faulted.steps:
        print(f"step {s.step}: {s.step_seconds:.2f} s (train {s.phase_seconds.get('train', 0):.2f} s), "
              f"{s.dp_cells} cell(s), restarts {s.cell_restarts}, loss {s.loss:.6f}")
    print("events:", [(e.at[11:19], e.kind, event_text(e)[:90]) for e in faulted.events if "cell" in e.kind])
    assert len(restarts) == 1 and restarts[0].cell_restarts == {"1": "restarting"} and restarts[0].step >= 3
    healed_at = next(s.step for s in faulted.steps if s.step > restarts[0].step and s.dp_cells == 2)
    assert all(s.dp_cells == 1 for s in faulted.steps[1 : healed_at - 1])  # one cell until the heal step
    assert all(s.dp_cells == 2 for s in faulted.steps[healed_at - 1 :])
    # the trajectory: within the reordering bound of the fault-free twin
    for a, b in zip(twin.steps, faulted.steps):
        assert b.loss == pytest.approx(a.loss, rel=1e-4, abs=1e-6), (a.step, a.loss, b.loss)
        assert b.reward_mean == a.reward_mean, a.step  # same samples: sampling saw (nearly) the same weights
    store = stack.workdir / "store"
    w_twin, w_faulted = final_weights(store, "twin", STEPS), final_weights(store, "faulted", STEPS)
    worst = max(float((w_twin[k] - w_faulted[k]).abs().max()) for k in w_twin)
    assert worst <= WEIGHT_ATOL, worst
