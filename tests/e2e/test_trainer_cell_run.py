"""trainer.backend fsdp2 through the real stack: the node's trainer process drives a 2-rank
FSDP2 cell (Ray actors in a placement group). The same tiny run with backend single is the
reference: per-step loss and final weights agree within float-sum reordering, and the cell's
checkpoints (sharded, under the store's manifest) are written. A rank SIGKILLed mid-step:
the run ends bitwise equal to its fault-free twin. No Ray process outlives the stack."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import ray  # noqa: F401  (a dev dependency: imported, so a broken install fails loudly)

from spec.events import CellFailed
from tests.e2e.faults import assert_bitwise_equal, final_weights, progress, run_to_end, start_run, wait_activity_started
from tests.stack import ROOT, Stack, async_wait_for, running_stack, tiny_config, wait_for
from workers.common import connect
from workflows.stubs import TRAIN_STEP

pytestmark = pytest.mark.e2e
STEPS = 2
WEIGHT_ATOL = 1e-5  # as tests/unit/test_trainer_cell.py (measured there: 5e-7 after 3 steps)


ENV = {"MILESTONE_FAULT_TRAIN_DELAY_S": "2"}  # a kill lands inside train_step


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("cell"), env=ENV) as s:
        yield s


@pytest.fixture(scope="module")
def runs(stack: Stack) -> tuple[list, list]:
    """The same tiny run with backend single ("single") and a 2-rank fsdp2 cell ("cell")."""
    store = stack.workdir / "store"

    async def main() -> tuple[list, list]:
        client = await connect(stack.server.address)
        single = await run_to_end(client, "single", cfg(store))
        cell = await run_to_end(client, "cell", cfg(store, backend="fsdp2", ranks_per_cell=2))
        assert single.policy_version == cell.policy_version == STEPS
        return (await progress(client, "single")).steps, (await progress(client, "cell")).steps

    return asyncio.run(main())


def cfg(store: Path, **trainer: object) -> dict:
    # 16 samples per step in micro-batches of 4: 2 per rank
    return tiny_config(store, steps=STEPS, sft={"steps": 20}, train={"lr": 1e-3, "micro_batch_size": 4},
                       checkpoint={"every": 1, "keep_last": 2}, eval={"enabled": False},
                       engines={"num_engines": 1}, **({"trainer": trainer} if trainer else {}))


def test_fsdp2_run_matches_single(stack: Stack, runs: tuple[list, list]) -> None:
    store = stack.workdir / "store"
    single_steps, cell_steps = runs
    for a, b in zip(single_steps, cell_steps):
        assert b.loss == pytest.approx(a.loss, rel=1e-5, abs=1e-7), (a, b)
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-5), (a, b)
    w_single, w_cell = final_weights(store, "single", STEPS), final_weights(store, "cell", STEPS)
    assert w_single.keys() == w_cell.keys()
    worst = max(float((w_single[k] - w_cell[k]).abs().max()) for k in w_single)
    assert worst <= WEIGHT_ATOL, worst
    manifest = json.loads((store / "runs" / "cell" / "checkpoints" / f"step-{STEPS:06d}" / "manifest.json").read_text())
    shards = sorted(n for n in manifest["files"] if n.startswith("shards/") and n.endswith(".distcp"))
    assert shards == ["shards/__0_0.distcp", "shards/__1_0.distcp"], manifest["files"].keys()


def status(stack: Stack, run_id: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "milestone_cli.main", "--address", stack.server.address,
                           "status", run_id, *flags], capture_output=True, text=True, cwd=ROOT, timeout=120)


def cells(stack: Stack, run_id: str) -> list[dict]:
    """The run's cells as ``milestone status --json`` lists them (as the trainer last reported)."""
    out = status(stack, run_id, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout).get("cells", [])


async def _committed(client: object, run_id: str, step: int) -> bool:
    try:
        return (await progress(client, run_id)).step >= step
    except Exception:  # noqa: BLE001 - not queryable yet
        return False


def rank_pids(stack: Stack, run_id: str) -> list[int]:
    return [r["pid"] for c in cells(stack, run_id) for r in c["ranks"]]


def test_rank_killed_mid_step_ends_bitwise_equal(stack: Stack, runs: tuple[list, list]) -> None:
    """One rank SIGKILLed from outside inside step 2's train_step, its pid read from
    ``milestone status --json`` (the cell and ranks the trainer last reported): the activity
    fails, the trainer rebuilds the cell (new placement group, new ranks) from the sharded checkpoint,
    and the run ends bitwise equal to the fault-free fsdp2 run; status then lists the new
    cell and a ``cell_rank_died`` event."""
    store = stack.workdir / "store"
    run_id = "cell-rank-kill"

    async def main() -> None:
        client = await connect(stack.server.address)
        handle = await start_run(client, run_id, cfg(store, backend="fsdp2", ranks_per_cell=2))
        # the cell that trained step 1 (status lists it once step 1 is committed) trains step 2;
        # read before step 2's train_step starts, so the kill lands inside it (the CLI takes seconds)
        await async_wait_for(lambda: _committed(client, run_id, 1), timeout_s=300, what="step 1 committed")
        before = cells(stack, run_id)
        assert len(before) == 1 and before[0]["node"] == "node0" and len(before[0]["ranks"]) == 2, before
        assert all(r["state"] == "alive" and r["node_ip"] for r in before[0]["ranks"]), before
        ranks = [r["pid"] for r in before[0]["ranks"]]
        assert all(psutil.pid_exists(p) for p in ranks), ranks
        await wait_activity_started(client, f"{run_id}/step-2", TRAIN_STEP.name)
        os.kill(ranks[-1], signal.SIGKILL)
        await asyncio.wait_for(handle.result(), 300)
        p = await progress(client, run_id)
        assert p.steps[1].restored_from_step is not None, p.steps[1]  # the cell was rebuilt from a checkpoint
        after = cells(stack, run_id)
        assert after[0]["generation"] > before[0]["generation"] and ranks[-1] not in rank_pids(stack, run_id)
        died = [e for e in p.events if isinstance(e, CellFailed) and e.kind == "cell_rank_died"]
        assert died and "rank 1 of the cell died" in died[0].message, p.events
        human = status(stack, run_id).stdout
        assert f"rank 1: pid {after[0]['ranks'][1]['pid']} node " in human, human

    asyncio.run(main())
    assert_bitwise_equal(final_weights(store, run_id, STEPS), final_weights(store, "cell", STEPS))


def test_no_ray_process_outlives_the_stack(stack: Stack) -> None:
    """Last in this module: the stack that ran the cell, stopped (node agent -> trainer by pid,
    the trainer's SIGTERM -> cell closed, ray.shutdown): none of the trainer's Ray processes is left."""
    trainer = stack.node_pids("node0")["trainer"]
    ray_pids = {p.pid for p in psutil.Process(trainer).children(recursive=True)}
    assert ray_pids, "the trainer process runs no Ray processes (the cell's run was the last)"
    ray_pids |= {p.pid for p in psutil.process_iter() if _pgid(p.pid) == trainer}  # agents raylet started
    stack.stop()

    def left() -> list[int]:
        return [p for p in ray_pids if _running(p)]

    try:  # a killed process may still be exiting when stop returns (CI once saw one right after)
        wait_for(lambda: not left(), 60, interval_s=0.2, what="the cell's Ray processes to exit")
    except TimeoutError:
        pass
    assert left() == [], f"processes of the cell outlived the stack: {left()}"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
