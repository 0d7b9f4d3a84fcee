"""How long until a run notices that its node agent is gone, before and after the
node liveness watch (``node.liveness_timeout_s``), on a real stack.

For each setting a tiny run starts on a two-node stack; while step 2 trains, the
agent that runs it is SIGKILLed, and the detection time is the run's ``node_lost``
event time minus the kill time. "before" is ``node.liveness_timeout_s: 0`` (the
activities' own 15 s heartbeat and 15 s schedule-to-start timeouts); "after" the
default watch. Then the same with both cores kept busy by two spinning processes,
and fault-free runs under that load, which must record no ``node_lost`` (no false
positive).

    python -m bench.bench_node_loss [--repeats 3] [--load-runs 2] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpu_runtime.proc.processes import stop_pid  # noqa: E402
from spec.run import NodeSpec  # noqa: E402
from tests.e2e.faults import progress, start_run, wait_activity_started  # noqa: E402
from tests.stack import Stack, async_wait_for, running_stack, tiny_config  # noqa: E402
from workers.common import connect  # noqa: E402
from workflows.stubs import TRAIN_STEP  # noqa: E402

ENV = {"MILESTONE_FAULT_TRAIN_DELAY_S": "3"}  # each train step waits first, so the kill lands inside it
CFG = {"steps": 3, "checkpoint": {"every": 3, "keep_last": 2}}


async def detect_once(stack: Stack, store: Path, run_id: str, node: dict) -> float:
    """Seconds from SIGKILL of the agent running step 2 to the run's node_lost event."""
    client = await connect(stack.server.address)
    handle = await start_run(client, run_id, tiny_config(store, node=node, **CFG))
    await wait_activity_started(client, f"{run_id}/step-2", TRAIN_STEP.name)
    queue = (await progress(client, run_id)).node_queue
    assert queue is not None
    node_id = queue.split("-")[1]
    proc = stack.procs[f"gpu-{node_id}"]
    killed = time.time()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)

    async def lost() -> float | None:
        ev = [e for e in (await progress(client, run_id)).events if e.kind == "node_lost"]
        return datetime.fromisoformat(ev[0].at).timestamp() - killed if ev else None

    seconds = await async_wait_for(lost, 180, what=f"{run_id} node_lost")
    await asyncio.wait_for(handle.result(), 300)
    stack.start_gpu(node_id)  # a fresh agent (new boot id): two nodes again for the next run
    return seconds


def spin(n: int) -> list[subprocess.Popen]:
    """``n`` processes that keep a CPU busy each (own session: stopped by pid)."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True) for _ in range(n)]


async def false_positives(stack: Stack, store: Path, run_id: str) -> int:
    """node_lost events of a fault-free run (default watch settings)."""
    client = await connect(stack.server.address)
    handle = await start_run(client, run_id, tiny_config(store, **CFG))
    await asyncio.wait_for(handle.result(), 900)
    return sum(e.kind == "node_lost" for e in (await progress(client, run_id)).events)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="kills per setting")
    p.add_argument("--load-runs", type=int, default=2, help="fault-free runs with both CPUs kept busy")
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    default = NodeSpec()
    after = f"after (watch: {default.liveness_timeout_s:g} s timeout, {default.liveness_interval_s:g} s heartbeats)"
    settings = {"before (watch off: 15 s heartbeat + 15 s schedule-to-start)": {"liveness_timeout_s": 0}, after: {}}
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench-node-loss-"))
    results: dict[str, list[float]] = {}
    spurious: list[int] = []
    with running_stack(workdir, env=ENV, gpu_nodes=("node0", "node1")) as stack:
        store = workdir / "store"
        for i, (name, node) in enumerate(settings.items()):
            results[name] = [
                asyncio.run(detect_once(stack, store, f"kill-{i}-{r}", node)) for r in range(args.repeats)
            ]
            print(f"{name}: " + ", ".join(f"{s:.1f}s" for s in results[name]), flush=True)
        hogs = spin(2)
        try:
            under_load = f"{after}, 2 CPU-spinning processes"
            results[under_load] = [
                asyncio.run(detect_once(stack, store, f"kill-load-{r}", {})) for r in range(args.repeats)
            ]
            print(f"{under_load}: " + ", ".join(f"{s:.1f}s" for s in results[under_load]), flush=True)
            spurious = [asyncio.run(false_positives(stack, store, f"load-{r}")) for r in range(args.load_runs)]
        finally:
            for h in hogs:
                stop_pid(h.pid, h)
    if args.repeats:
        print("\nnode-loss detection (SIGKILL of the agent -> node_lost event), this machine:")
        print(f"{'setting':<100} {'mean':>6} {'min':>6} {'max':>6}")
        for name, xs in results.items():
            print(f"{name:<100} {statistics.fmean(xs):>5.1f}s {min(xs):>5.1f}s {max(xs):>5.1f}s")
        before, now = statistics.fmean(results[next(iter(settings))]), statistics.fmean(results[after])
        print(f"ratio before/after: {before / now:.1f}x")
    print(f"fault-free runs with 2 CPU-spinning processes (3 steps each): node_lost events {spurious}")


if __name__ == "__main__":
    main()
