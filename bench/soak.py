"""A seeded random-fault soak of a DP-cells run on a real stack (docs/soak.md).

It starts its own stack (Temporal dev server, control worker, one node agent) and one
tiny run with ``trainer.cells: 2``, and while the run goes a ``random.Random(seed)``
schedule injects, one at a time: SIGKILL or SIGSTOP of a DP cell (only while both are
alive, so one always is), SIGKILL of an engine, of the torchft lighthouse, SIGKILL +
restart of the control worker, restart of the Temporal server. Each fault waits for its
target to be there and then for the run to commit more steps before the next. At the end
it checks: the run completed every step within ``--timeout-s``; each killed / stopped cell
was lost (a stopped one timed out and killed by its group, never answering again) and its
cell healed from its peer afterwards (or was hit by the next fault first), >= 2 heals in
all; every lighthouse kill restarted it once; every prompt
trained exactly once, by sample id, across ``0 .. data cursor`` (bench/soak_checks.py);
the cells alive and bitwise equal at the end; the histories replay. Exit 1 when one fails.

    python -m bench.soak --steps 30 --seed 1 [--workdir DIR] [--timeout-s S]

The schedule (kinds, targets, delays, gaps) is a function of the seed and printed first;
where a fault lands in a step is up to timing, so a replay with the same seed injects the
same faults in the same order at about the same points.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from temporalio.client import Client  # noqa: E402
from temporalio.contrib.pydantic import pydantic_data_converter  # noqa: E402
from temporalio.worker import Replayer  # noqa: E402

from bench.soak_checks import cells_whole, trained_exactly_once  # noqa: E402
from gpu_runtime.proc.processes import pid_alive  # noqa: E402
from spec.events import CellHealed, CellLost, RunEvent  # noqa: E402
from tests.e2e.faults import start_run  # noqa: E402
from tests.stack import Stack, running_stack, tiny_config  # noqa: E402
from workers.common import connect  # noqa: E402
from workflows.run_state import RunProgress  # noqa: E402
from workflows.training_run import RUN_WORKFLOWS, TrainingRun  # noqa: E402

CELL_FAULTS = ("cell_kill", "cell_stop")
KINDS = (*CELL_FAULTS, "engine_kill", "lighthouse_kill", "control_restart", "server_restart")
WEIGHTS = {"cell_kill": 3, "cell_stop": 1, "engine_kill": 2, "lighthouse_kill": 2, "control_restart": 1,
           "server_restart": 1}  # extra faults beyond one of each: a SIGSTOP costs ~20 s, kills are cheap
RESERVE_STEPS = 3  # no fault once the run is this close to its end: the last heal must finish
READY_TIMEOUT_S = 180.0  # a fault's target (both cells alive, engines healthy) must be there by then
COMMIT_TIMEOUT_S = 240.0  # the run must commit the steps after a fault by then
QUERY_TIMEOUT_S = 20.0
COLLECTIVE_TIMEOUT_S = 10.0
# fault-injection aids, so faults land inside steps: decoding slowed (a kill lands mid-rollout),
# cell 1 waits before each allreduce (a cell fault lands mid-train while its peer waits on it)
STACK_ENV = {"MILESTONE_ENGINE_STEP_DELAY_MS": "100", "MILESTONE_FAULT_CELL_DELAY": "1:0.5"}


def soak_config(store: Path, steps: int) -> dict:
    """The soaked run: tiny, two DP cells, two engines, checkpoints every 5 steps, no eval."""
    return tiny_config(store, steps=steps, sft={"steps": 20}, train={"lr": 1e-3, "micro_batch_size": 4},
                       checkpoint={"every": 5, "keep_last": 2}, eval={"enabled": False},
                       engines={"num_engines": 2},
                       trainer={"cells": 2, "cell_restart_backoff_s": 1, "collective_timeout_s": COLLECTIVE_TIMEOUT_S})


@dataclass(frozen=True)
class Planned:
    kind: str
    target: int  # the cell or engine slot (cell_* / engine_kill)
    delay_s: float  # after the target is ready: varies where in a step the fault lands
    gap_steps: int  # steps the run must commit after it before the next fault


def plan(rng: random.Random, steps: int) -> list[Planned]:
    """One fault of each kind plus extras, shuffled, then the first two cell faults moved to
    the first and third place, so even a run that ends early has had >= 2 heals."""
    n = max(len(KINDS), (steps - 6) // 4)
    kinds = list(KINDS) + rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()), k=n - len(KINDS))
    rng.shuffle(kinds)
    cells = [i for i, k in enumerate(kinds) if k in CELL_FAULTS][:2]
    rest = [k for i, k in enumerate(kinds) if i not in cells]
    kinds = [kinds[cells[0]], rest[0], kinds[cells[1]], *rest[1:]]
    return [Planned(k, rng.randrange(2), round(rng.uniform(0.0, 2.0), 2), rng.randint(1, 2)) for k in kinds]


@dataclass
class Fault:
    at_s: float  # since the run started
    step: int  # the run's last committed step when it was injected
    kind: str
    pid: int

    def line(self) -> str:
        return f"[{self.at_s:7.1f}s] step {self.step:3d}: {self.kind:<15} pid {self.pid}"


@dataclass
class SoakResult:
    seed: int
    steps: int
    wall_s: float = 0.0
    planned: int = 0
    faults: list[Fault] = field(default_factory=list)
    events: list[RunEvent] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def heals(self) -> int:
        return sum(e.kind == "cell_healed" for e in self.events)

    def unplanned_losses(self) -> int:
        hit = {f.pid for f in self.faults if f.kind in CELL_FAULTS}
        return sum(isinstance(e, CellLost) and e.pid not in hit for e in self.events)

    @property
    def ok(self) -> bool:
        return not self.failures

    def report(self) -> str:
        kinds = Counter(f.kind for f in self.faults)
        ev = Counter(e.kind for e in self.events)
        xs = sorted(self.step_seconds) or [0.0]
        lines = [
            f"soak seed {self.seed}: {self.steps} steps in {self.wall_s:.0f} s, "
            f"{len(self.faults)}/{self.planned} planned faults injected",
            "faults: " + ", ".join(f"{k} {kinds[k]}" for k in KINDS),
            f"heals (cell_healed): {self.heals}; events: " + ", ".join(
                f"{k} {ev[k]}" for k in ("cell_lost", "cell_restarted", "cell_healed", "lighthouse_restarted",
                                         "engine_dead", "engine_restarted", "trainer_restarted", "checksum_mismatch",
                                         "cells_diverged")),
            f"cells lost without a cell fault (a side effect of another fault): {self.unplanned_losses()}",
            f"step seconds: mean {statistics.fmean(xs):.2f}, median {statistics.median(xs):.2f}, "
            f"p90 {xs[int(0.9 * (len(xs) - 1))]:.2f}, max {xs[-1]:.2f}",
        ]
        lines += [f"FAILED: {f}" for f in self.failures] or ["all soak checks passed"]
        return "\n".join(lines)


class Soak:
    """Drives one run through its fault schedule and keeps every event it saw (the run's
    progress keeps only its last 100)."""

    def __init__(self, stack: Stack, run_id: str, cfg: dict) -> None:
        self.stack, self.run_id, self.cfg = stack, run_id, cfg
        self.client: Client | None = None
        self.t0 = time.monotonic()
        self.events: dict[str, RunEvent] = {}  # by the event's JSON: each once
        self.faults: list[Fault] = []
        self.last: RunProgress | None = None
        self.stopped: list[int] = []  # SIGSTOPped cells

    async def query(self) -> RunProgress | None:
        """The run's progress, or None while the server or the control worker is down."""
        try:
            if self.client is None:
                self.client = await asyncio.wait_for(connect(self.stack.server.address), QUERY_TIMEOUT_S)
            handle = self.client.get_workflow_handle(self.run_id)
            p = await asyncio.wait_for(handle.query(TrainingRun.progress), QUERY_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a restarting server or worker: ask again
            self.client = None
            return None
        for e in p.events:
            self.events.setdefault(e.model_dump_json(), e)
        self.last = p
        return p

    async def until(self, cond, timeout_s: float, what: str) -> RunProgress:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            p = await self.query()
            if p is not None and cond(p):
                return p
            await asyncio.sleep(0.3)
        raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what} (last step "
                           f"{self.last.step if self.last else '?'})")

    def finished(self, p: RunProgress) -> bool:
        return p.state in ("completed", "failed") or p.step >= p.total_steps - RESERVE_STEPS

    async def run_schedule(self, schedule: list[Planned]) -> None:
        for f in schedule:
            while True:
                p = await self.until(lambda p, f=f: self.finished(p) or self.ready(f, p) is not None, READY_TIMEOUT_S,
                                     f"{f.kind}'s target")
                if self.finished(p):
                    print(f"[{self.now():7.1f}s] the run is at step {p.step} of {p.total_steps}: no more faults",
                          flush=True)
                    return
                await asyncio.sleep(f.delay_s)  # where in the step it lands
                p = await self.until(lambda p: True, 60, "the run's progress")
                pid = self.ready(f, p)
                if pid is not None and not self.finished(p):
                    break  # else the target moved on during the delay: wait for it again
            fault = Fault(self.now(), p.step, f.kind, pid)
            self.faults.append(fault)
            print(fault.line(), flush=True)
            self.inject(f.kind, pid)
            if f.kind == "server_restart":
                self.client = None
            await self.until(lambda p, s=p.step + f.gap_steps: p.step >= s or p.state in ("completed", "failed"),
                             COMMIT_TIMEOUT_S, f"step {p.step + f.gap_steps} after {f.kind}")

    def ready(self, f: Planned, p: RunProgress) -> int | None:
        """The pid ``f`` hits now, or None while its target is not there (a cell fault needs
        both cells alive and none waiting for a restart)."""
        if p.state != "running":
            return None
        if f.kind in CELL_FAULTS:
            if p.dp is None or p.cell_heal or any(c.state != "alive" for c in p.dp.cells):
                return None
            if any(_runs(pid, "gpu_runtime.trainer.dp.cell_server") for pid in self.stopped):
                return None  # a stopped cell is a fault in progress: its group has not timed it out yet
            pid = p.dp.cells[f.target].pid
            return pid if _runs(pid, "gpu_runtime.trainer.dp.cell_server", f"--index\0{f.target}\0") else None
        if f.kind == "engine_kill":
            if len(p.engines) < 2 or any(e.state != "healthy" for e in p.engines):
                return None
            pid = p.engines[f.target].pid
            return pid if pid and _runs(pid, "gpu_runtime.engine.server") else None
        if f.kind == "lighthouse_kill":
            pid = p.dp.lighthouse_pid if p.dp else 0
            return pid if pid and _runs(pid, "lighthouse") else None
        if f.kind == "control_restart":
            return self.stack.procs["control"].pid
        return self.stack.server.proc.pid if self.stack.server.proc else None

    def inject(self, kind: str, pid: int) -> None:
        if kind == "control_restart":
            self.stack.kill("control")
            self.stack.start_control()
        elif kind == "server_restart":
            self.stack.server.restart()  # same port, same SQLite file
        elif kind == "cell_stop":
            self.stopped.append(pid)
            os.kill(pid, signal.SIGSTOP)
        else:
            os.kill(pid, signal.SIGKILL)

    def release(self) -> list[int]:
        """End the stopped cells their group has not killed (a failure: they are returned); a
        stopped process cannot act on its parent's death."""
        left = [pid for pid in self.stopped if _runs(pid, "gpu_runtime.trainer.dp.cell_server")]
        for pid in left:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        return left

    def now(self) -> float:
        return time.monotonic() - self.t0


def _runs(pid: int, *parts: str) -> bool:
    """``pid`` is alive and its command line has ``parts`` (never signal a reused pid)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False
    return pid_alive(pid) and all(x in cmd for x in parts)


def fault_checks(faults: list[Fault], events: list[RunEvent]) -> list[str]:
    """Each cell fault cost its cell (a stopped one: timed out and killed by its group), and
    that cell healed from its peer afterwards, unless another fault hit it first (a kill
    landing in its heal step); each lighthouse kill was restarted (or hit a lighthouse being
    started, whose start failed, and a later restart answered both); >= 2 cell heals.
    ``events`` in time order."""
    out = []
    fault_pids = {f.pid for f in faults if f.kind in CELL_FAULTS}
    for f in faults:
        if f.kind in CELL_FAULTS:
            at = next((k for k, e in enumerate(events) if isinstance(e, CellLost) and e.pid == f.pid), None)
            if at is None:
                out.append(f"{f.kind} of pid {f.pid} at step {f.step}: no cell_lost event names it")
                continue
            lost = events[at]
            assert isinstance(lost, CellLost)
            if f.kind == "cell_stop" and "hung or stopped" not in lost.why:
                out.append(f"stopped cell pid {f.pid}: lost for another reason: {lost.why}")
            if _runs(f.pid, "gpu_runtime.trainer.dp.cell_server"):
                out.append(f"{f.kind} of pid {f.pid}: the process is still there (not killed by its group)")
            if not _healed_after(events, at, fault_pids):
                out.append(f"{f.kind} of pid {f.pid} at step {f.step}: its cell never healed afterwards")
    # a kill can land on a lighthouse the watchdog is still starting: that start fails
    # (lighthouse_restart_failed) and the next one answers for both kills
    lighthouse = [e.kind for e in events if e.kind in ("lighthouse_restarted", "lighthouse_restart_failed")]
    kills = sum(f.kind == "lighthouse_kill" for f in faults)
    if len(lighthouse) != kills or (kills and lighthouse[-1] != "lighthouse_restarted"):
        out.append(f"{kills} lighthouse kills, {lighthouse.count('lighthouse_restarted')} lighthouse_restarted and "
                   f"{lighthouse.count('lighthouse_restart_failed')} lighthouse_restart_failed events"
                   + (", the last a failure" if lighthouse and lighthouse[-1] != "lighthouse_restarted" else ""))
    heals = sum(e.kind == "cell_healed" for e in events)
    if heals < 2:
        out.append(f"{heals} cell heals (need >= 2)")
    return out


def _healed_after(events: list[RunEvent], at: int, fault_pids: set[int]) -> bool:
    """Whether the cell lost at ``events[at]`` has a ``cell_healed`` later, or is hit by
    another fault before one."""
    lost = events[at]
    assert isinstance(lost, CellLost)
    for e in events[at + 1:]:
        if isinstance(e, CellHealed) and e.cell == lost.cell:
            return True
        if isinstance(e, CellLost) and e.cell == lost.cell and e.pid in fault_pids:
            return True
    return False


async def replay(client: Client, run_id: str, steps: int) -> list[str]:
    """The run's and its steps' histories replay on this code (no nondeterminism after the
    restarts of the worker and the server)."""
    replayer = Replayer(workflows=RUN_WORKFLOWS, data_converter=pydantic_data_converter)
    out = []
    for wid in [run_id, *(f"{run_id}/step-{s}" for s in range(1, steps + 1))]:
        try:
            await replayer.replay_workflow(await client.get_workflow_handle(wid).fetch_history())
        except Exception as err:  # noqa: BLE001 - reported
            out.append(f"history of {wid} does not replay: {err}")
    return out


async def drive(stack: Stack, steps: int, seed: int, timeout_s: float, run_id: str = "soak") -> SoakResult:
    rng = random.Random(seed)
    schedule = plan(rng, steps)
    print("schedule: " + ", ".join(f"{f.kind}[{f.target}] +{f.delay_s}s/{f.gap_steps}" for f in schedule), flush=True)
    res = SoakResult(seed=seed, steps=steps, planned=len(schedule))
    store = stack.workdir / "store"
    cfg = soak_config(store, steps)
    client = await connect(stack.server.address)
    await start_run(client, run_id, cfg)
    soak = Soak(stack, run_id, cfg)
    try:
        await asyncio.wait_for(_run(soak, schedule), timeout_s)
    except TimeoutError as err:  # the whole run's (no message) or a wait's
        res.failures.append(f"stuck: {err}" if str(err) else f"the run did not complete within {timeout_s:.0f} s")
    finally:
        left = soak.release()
    if left:
        res.failures.append(f"stopped cells {left} were never killed by their group")
    res.wall_s, res.faults = soak.now(), soak.faults
    p = soak.last if res.failures else await soak.until(lambda p: True, 60, "the final progress")
    res.events = sorted(soak.events.values(), key=lambda e: e.at)
    if p is None:
        return res
    res.step_seconds = [s.step_seconds for s in p.steps]
    if res.failures:
        return res
    if p.state != "completed" or p.step != steps or p.policy_version != steps:
        res.failures.append(f"the run ended {p.state} at step {p.step} (v{p.policy_version}), not {steps}")
    res.failures += fault_checks(res.faults, res.events)
    res.failures += trained_exactly_once(store, run_id, cfg, p)
    res.failures += cells_whole(p)
    if "cells_diverged" in {e.kind for e in res.events}:
        res.failures.append("the cells diverged (cells_diverged)")
    res.failures += await replay(await connect(stack.server.address), run_id, steps)
    return res


async def _run(soak: Soak, schedule: list[Planned]) -> None:
    await soak.run_schedule(schedule)
    await soak.until(lambda p: p.state in ("completed", "failed"), 10**6, "the run's end")


def soak(steps: int, seed: int, workdir: Path, timeout_s: float) -> SoakResult:
    """One soak on a stack of its own under ``workdir`` (stopped, by pid, however it ends)."""
    print(f"soak seed {seed} ({steps} steps, workdir {workdir})", flush=True)
    with running_stack(workdir, env=STACK_ENV) as stack:
        return asyncio.run(drive(stack, steps, seed, timeout_s))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=None, help="the fault schedule's seed (default: random, printed)")
    p.add_argument("--workdir", default=None, help="the stack's folder (logs, store); default: a new temp dir")
    p.add_argument("--timeout-s", type=float, default=None, help="the whole run's limit (default 120 + 15 s/step)")
    args = p.parse_args()
    if args.steps < RESERVE_STEPS + 6:
        p.error(f"--steps must be >= {RESERVE_STEPS + 6} (faults stop {RESERVE_STEPS} steps before the end)")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="soak-"))
    res = soak(args.steps, seed, workdir, args.timeout_s or 120 + 15 * args.steps)
    print(res.report(), flush=True)
    print(f"replay: python -m bench.soak --steps {args.steps} --seed {seed}", flush=True)
    sys.exit(0 if res.ok else 1)


if __name__ == "__main__":
    main()
