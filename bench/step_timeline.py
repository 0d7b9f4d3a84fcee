"""Where an RL step's wall time goes, read from the Temporal history (not guessed).

Runs the demo run (as ``bench.bench_rl_step``) on a fresh stack, then reads the
history of every ``RLStep`` child and of the ``TrainingRun`` parent and splits each
step's time, close to close, into:

- ``<activity> queue``: ActivityTaskScheduled -> ActivityTaskStarted (the task waits in
  the matching service until a worker poll takes it: dispatch latency);
- ``<activity> run``: ActivityTaskStarted -> ActivityTaskCompleted, as the server saw
  it; ``<activity> in-activity`` is the seconds the activity measured itself, and
  the difference (``<activity> outside``) is payload decode/encode, the node agent's
  thread hand-off and the completion RPC;
- ``workflow tasks``: each WorkflowTaskScheduled -> WorkflowTaskCompleted (the workflow
  code and the control worker's poll round trip) inside the child;
- ``between steps``: the child's close -> the next child's first event (the parent's
  workflow task, the child start);
- ``unattributed``: what is left (overlapping activities, e.g. one_step_off's prefetch).

    PYTHONPATH=. .venv/bin/python -m bench.step_timeline [--steps 8] [--mode sync]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from temporalio.api.enums.v1 import EventType  # noqa: E402
from temporalio.client import Client  # noqa: E402

from bench._inproc import demo_config  # noqa: E402
from spec.run import RunConfig  # noqa: E402
from tests.e2e.faults import progress, run_to_end  # noqa: E402
from tests.stack import Stack  # noqa: E402
from workers.common import connect  # noqa: E402
from workflows.stubs import (  # noqa: E402
    CHECKPOINT, COMPUTE_REWARDS_ON_NODE, ROLLOUT, TRAIN_STEP, UPDATE_WEIGHTS,
)

RUN_ID = "step-timeline"
# the StepSummary phase each activity's own seconds are reported under (rewards: scored on the
# node that holds the samples)
PHASE_OF = {ROLLOUT.name: "rollout", COMPUTE_REWARDS_ON_NODE.name: "reward", TRAIN_STEP.name: "train",
            UPDATE_WEIGHTS.name: "update_weights", CHECKPOINT.name: "checkpoint"}


def _t(ev) -> float:
    return ev.event_time.ToMicroseconds() / 1e6


async def child_timeline(client: Client, workflow_id: str) -> dict[str, float]:
    """Seconds per segment of one RLStep child, from its history."""
    out: dict[str, float] = collections.defaultdict(float)
    scheduled: dict[int, tuple[str, float]] = {}  # scheduled event id -> (activity, time)
    started: dict[int, float] = {}
    wt_scheduled: float | None = None
    wt_started = 0.0
    first = last = None
    async for ev in client.get_workflow_handle(workflow_id).fetch_history_events():
        t = _t(ev)
        first = t if first is None else first
        last = t
        et = ev.event_type
        if et == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            a = ev.activity_task_scheduled_event_attributes
            scheduled[ev.event_id] = (a.activity_type.name, t)
            out["payload bytes in"] += sum(len(p.data) for p in a.input.payloads)
        elif et == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            sid = ev.activity_task_started_event_attributes.scheduled_event_id
            name, ts = scheduled[sid]
            out[f"{name} queue"] += t - ts
            started[sid] = t
        elif et == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            a = ev.activity_task_completed_event_attributes
            name, _ = scheduled[a.scheduled_event_id]
            out[f"{name} run"] += t - started[a.scheduled_event_id]
            out["payload bytes out"] += sum(len(p.data) for p in a.result.payloads)
        elif et == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
            wt_scheduled = t
        elif et == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED and wt_scheduled is not None:
            out["workflow task queue"] += t - wt_scheduled
            wt_started = t
        elif et == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and wt_scheduled is not None:
            out["workflow task run"] += t - wt_started
            out["workflow tasks"] += t - wt_scheduled
            out["workflow task count"] += 1
            wt_scheduled = None
        elif et == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED:
            out["result bytes"] += sum(
                len(p.data) for p in ev.workflow_execution_completed_event_attributes.result.payloads)
    out["history events"] = float(last is not None and ev.event_id)
    out["child wall"] = (last or 0.0) - (first or 0.0)
    out["_first"], out["_last"] = first or 0.0, last or 0.0
    return out


async def timeline(address: str, cfg: RunConfig, run_id: str) -> tuple[list[dict[str, float]], list]:
    client = await connect(address)
    await run_to_end(client, run_id, cfg.model_dump(mode="json"), timeout_s=3600)
    prog = await progress(client, run_id)
    rows = [await child_timeline(client, f"{run_id}/step-{s.step}") for s in prog.steps]
    return rows, prog.steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sft-steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--mode", default="sync")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="step-timeline-") as tmp:
        work = Path(tmp)
        cfg = demo_config(work / "store", steps=args.steps, sft_steps=args.sft_steps, every=args.every,
                          keep_last=3, name=RUN_ID)
        raw = cfg.model_dump(mode="json", exclude_unset=True)
        raw["rollout"] = {**raw.get("rollout", {}), "mode": args.mode}
        cfg = RunConfig.model_validate(raw)
        stack = Stack(work / "stack")
        try:
            stack.start()
            t = time.monotonic()
            rows, steps = asyncio.run(timeline(stack.server.address, cfg, RUN_ID))
            print(f"run {time.monotonic() - t:.1f}s, load average {os.getloadavg()[0]:.1f}")
        finally:
            stack.stop()
    rows, steps = rows[1:], steps[1:]  # step 1 is warm-up
    gaps = [b["_first"] - a["_last"] for a, b in zip(rows, rows[1:])]
    keys = sorted({k for r in rows for k in r if not k.startswith("_")})
    print(f"mean over steps 2..{args.steps} (mode {args.mode}):")
    for k in keys:
        print(f"  {k:<28} {statistics.fmean(r.get(k, 0.0) for r in rows):>10.4f}")
    for name, phase in PHASE_OF.items():
        run = statistics.fmean(r.get(f"{name} run", 0.0) for r in rows)
        inside = statistics.fmean(s.phase_seconds.get(phase, 0.0) for s in steps)
        print(f"  {name + ' outside':<28} {run - inside:>10.4f}  "
              f"(server-seen run {run:.4f} - in-activity {inside:.4f})")
    print(f"  {'between steps':<28} {statistics.fmean(gaps) if gaps else float('nan'):>10.4f}")
    acts = statistics.fmean(sum(v for k, v in r.items() if k.endswith((" queue", " run"))
                                and not k.startswith("workflow")) for r in rows)
    wts = statistics.fmean(r["workflow tasks"] for r in rows)
    wall = statistics.fmean(r["child wall"] for r in rows)
    print(f"  {'unattributed (child)':<28} {wall - acts - wts:>10.4f}  (child wall {wall:.4f})")


if __name__ == "__main__":
    main()
