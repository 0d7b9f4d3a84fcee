"""Cost of running each RL step as a Temporal workflow, against a plain in-process loop.

Runs a short RL run of the demo model (examples/demo.yaml: 2.4 M parameters,
16 prompts x 8 samples, 2 torch engines; no held-out eval, like the plain loop) on a
real stack (Temporal dev server + ``workers.control`` + ``workers.gpu``; trainer and
engines are their own processes),
SFT cut to ``--sft-steps`` and a checkpoint every ``--every`` steps, store in a temp
dir. Then does the same work without Temporal in one process: the same SFT, then per
step ``generate_batch`` over the same chunks (same seeds), ``score_samples``,
``PolicyTrainer.train_step``, a weight copy into the generation model, and every
``--every`` steps a state snapshot + ``CheckpointStore.save_written`` (written and uploaded on its
thread, local store; the last one waited for), as the project's trainer checkpoints.

Prints the 1-minute load average before and after each run (the ratios compare runs
made one after another: on a shared machine they move with the load), per-phase mean
seconds per step, step wall time, the sum of the activity times, the orchestration
overhead (step wall - activities) and its share, and the ratio Temporal / plain loop. Step 1 is excluded from every mean (warm-up).

With ``--modes sync,one_step_off`` (the default; add ``fully_async``, whose buffer depth
is ``--max-staleness``, default 2) the Temporal run is made once per ``rollout.mode``,
each on a fresh stack, and a last table gives each mode's step cadence (close-to-close
of the RLStep children: in one_step_off and fully_async a step's rollout runs during an
earlier step, so only the cadence compares) against the plain loop.

    .venv/bin/python -m bench.bench_rl_step [--steps 12] [--sft-steps 50] [--every 4] \
        [--modes sync,one_step_off,fully_async] [--max-staleness 2]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._inproc import PlainLoop, demo_config  # noqa: E402
from bench.step_timeline import child_timeline  # noqa: E402
from gpu_runtime.store.checkpoint_store import CheckpointStore  # noqa: E402
from gpu_runtime.trainer.common.snapshot import SnapshotBuffers  # noqa: E402
from gpu_runtime.models.model_folder import read_meta  # noqa: E402
from gpu_runtime.store.object_store import LocalStore  # noqa: E402
from spec.run import RunConfig  # noqa: E402
from tests.e2e.faults import progress, run_to_end  # noqa: E402
from tests.stack import Stack  # noqa: E402
from workers.common import connect  # noqa: E402

log = logging.getLogger("bench_rl_step")
PHASES = ["rollout", "reward", "train", "update_weights", "checkpoint"]
RUN_ID = "bench-rl-step"


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


# ---------------------------------------------------------------- Temporal
async def temporal_run(cfg: RunConfig, address: str, run_id: str) -> dict:
    client = await connect(address)
    t0 = time.monotonic()
    summary = await run_to_end(client, run_id, cfg.model_dump(mode="json"), timeout_s=3600)
    total = time.monotonic() - t0
    prog = await progress(client, run_id)
    closes = []  # RLStep child close times: close-to-close includes the parent's work between steps
    for s in prog.steps:
        desc = await client.get_workflow_handle(f"{run_id}/step-{s.step}").describe()
        closes.append(desc.close_time.timestamp())
    first_start = (await client.get_workflow_handle(f"{run_id}/step-1").describe()).start_time.timestamp()
    run_start = (await client.get_workflow_handle(run_id).describe()).start_time.timestamp()
    # each RLStep child's history read back (bench.step_timeline): its first and last event times, payload bytes
    timelines = [await child_timeline(client, f"{run_id}/step-{s.step}") for s in prog.steps]
    return {"summary": summary, "steps": prog.steps, "closes": closes, "total": total,
            "init": first_start - run_start, "run_start": run_start, "timelines": timelines}


def measure_temporal(cfg: RunConfig, work: Path, run_id: str = RUN_ID,
                     watch: Callable[[Stack], AbstractContextManager[object]] | None = None) -> dict:
    """``cfg`` run to its end on a fresh stack in ``work/stack-<run_id>``. ``watch(stack)``: a
    context entered once the stack is up and left before it stops (``out["watched"]``)."""
    stack = Stack(work / f"stack-{run_id}")
    try:
        t = time.monotonic()
        stack.start()
        started = time.monotonic() - t
        with watch(stack) if watch is not None else nullcontext() as watched:
            out = asyncio.run(temporal_run(cfg, stack.server.address, run_id))
        out["stack_start"] = started
        out["watched"] = watched
        return out
    finally:
        stack.stop()


def with_mode(cfg: RunConfig, mode: str, max_staleness: int = 2) -> RunConfig:
    """``cfg`` with ``rollout.mode``, validated again (one_step_off and fully_async bring their
    TIS default; fully_async its ``max_staleness``)."""
    raw = cfg.model_dump(mode="json", exclude_unset=True)
    raw["rollout"] = {**raw.get("rollout", {}), "mode": mode,
                      **({"max_staleness": max_staleness} if mode == "fully_async" else {})}
    return RunConfig.model_validate(raw)


def cadence(closes: list[float]) -> float:
    """Mean seconds between RLStep closes from step 2 on (step n close - step n-1 close)."""
    return mean([b - a for a, b in zip(closes, closes[1:])])


# ---------------------------------------------------------------- plain loop
def measure_plain(cfg: RunConfig, work: Path) -> dict:
    """The same steps in one process and one torch thread, nothing between the pieces."""
    torch.set_num_threads(1)  # like the trainer and each engine process of the stack
    loop = PlainLoop(cfg, work)
    loop.sft()
    trainer = loop.trainer
    ckpts = CheckpointStore(LocalStore(work / "plain-store"), "plain/checkpoints", local_dir=work / "plain-ckpt",
                            keep_last=cfg.checkpoint.keep_last, keep_local=False)
    buffers = SnapshotBuffers()
    warming: threading.Thread | None = None
    steps = []
    try:
        for step in range(1, cfg.steps + 1):
            ph: dict[str, float] = {}
            t_step = time.perf_counter()
            t = time.perf_counter()
            samples = loop.rollout(step)
            ph["rollout"] = time.perf_counter() - t
            t = time.perf_counter()
            rewards = loop.rewards(samples)
            ph["reward"] = time.perf_counter() - t
            t = time.perf_counter()
            loop.train(samples, rewards)
            if warming is None or not warming.is_alive():  # the snapshot's buffers, as the project's trainer does
                warming = buffers.warm(buffers.missing(trainer.live_state()[0]))
            ph["train"] = time.perf_counter() - t
            t = time.perf_counter()
            loop.update_weights()
            ph["update_weights"] = time.perf_counter() - t
            t = time.perf_counter()
            # the checkpoint as the project takes it, in-process: wait for the previous one, snapshot the
            # state into reused buffers, write + hash + upload on the store's thread (the last one: wait)
            parts: dict[str, float] = {}
            if step % cfg.checkpoint.every == 0 or step == cfg.steps:
                ckpts.wait_for_uploads()
                parts["wait_previous"] = time.perf_counter() - t
                snap = trainer.state_snapshot(buffers)
                parts["snapshot"] = time.perf_counter() - t - parts["wait_previous"]
                ckpts.save_written(step, snap.write, {"step": step, "policy_version": trainer.policy_version},
                                   sync=step == cfg.steps)
            ph["checkpoint"] = time.perf_counter() - t
            steps.append({"phases": ph, "wall": time.perf_counter() - t_step, "end": time.time(),
                          "checkpointed": bool(parts), "checkpoint_parts": parts})
    finally:
        ckpts.close(120)
    return {"steps": steps, "checksum": trainer.checksum(), "trainer": trainer}


# ---------------------------------------------------------------- report
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--sft-steps", type=int, default=50)
    ap.add_argument("--every", type=int, default=4, help="checkpoint every k steps")
    ap.add_argument("--modes", default="sync,one_step_off",
                    help="rollout.mode values to run, comma-separated (sync, one_step_off, fully_async)")
    ap.add_argument("--max-staleness", type=int, default=2, help="rollout.max_staleness of the fully_async run")
    args = ap.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or modes[0] != "sync":
        ap.error("--modes must start with sync (the per-phase table and the bitwise check compare it)")
    bad = [m for m in modes if m not in ("sync", "one_step_off", "fully_async")]
    if bad:
        ap.error(f"--modes: {', '.join(bad)}: not a rollout.mode (sync, one_step_off, fully_async)")
    if args.max_staleness < 1:
        ap.error("--max-staleness must be >= 1")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.steps < 2:
        ap.error("--steps must be >= 2 (step 1 is excluded as warm-up)")

    with tempfile.TemporaryDirectory(prefix="bench-rl-step-") as tmp:
        work = Path(tmp)
        cfg = demo_config(work / "store", steps=args.steps, sft_steps=args.sft_steps, every=args.every,
                          keep_last=3, name=RUN_ID)
        # the plain loop evaluates nothing: neither does the run (demo.yaml evaluates after the last
        # step, which put ~1 s of held-out eval into one step's wall and the cadence)
        cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"enabled": False})})
        print(f"demo model {cfg.model.init.hidden_size}h x {cfg.model.init.num_hidden_layers}L, "
              f"{cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size} samples/step, "
              f"{cfg.engines.num_engines} engines, SFT {cfg.sft.steps} steps, {cfg.steps} RL steps, "
              f"checkpoint every {cfg.checkpoint.every}", flush=True)

        runs: dict[str, dict] = {}
        for mode in modes:
            run_id = RUN_ID if mode == "sync" else f"{RUN_ID}-{mode.replace('_', '-')}"
            load = os.getloadavg()[0]
            runs[mode] = measure_temporal(with_mode(cfg, mode, args.max_staleness), work, run_id)
            print(f"temporal {mode}: stack start {runs[mode]['stack_start']:.1f}s, run {runs[mode]['total']:.1f}s "
                  f"(init incl. SFT {runs[mode]['init']:.1f}s), load average {load:.1f} -> {os.getloadavg()[0]:.1f}",
                  flush=True)
        tem = runs["sync"]
        t, load = time.monotonic(), os.getloadavg()[0]
        plain = measure_plain(cfg, work)
        print(f"plain loop: {time.monotonic() - t:.1f}s incl. SFT, load average {load:.1f} -> "
              f"{os.getloadavg()[0]:.1f}", flush=True)

        ts = [s for s in tem["steps"] if s.step > 1]
        ps = plain["steps"][1:]

        def row(name: str, a: float, b: float | None) -> None:
            if b is None:
                print(f"{name:<30} {a:>10.3f}s {'-':>11} {'':>7}")
            else:
                ratio = f"{a / b:>6.1f}x" if b > 1e-4 else f"{'n/a':>7}"
                print(f"{name:<30} {a:>10.3f}s {b:>10.3f}s {ratio}")

        print()
        print(f"{f'per step (mean of steps 2..{cfg.steps})':<30} {'temporal':>11} {'plain loop':>11} {'ratio':>7}")
        for p in PHASES:
            row(f"  {p}", mean([s.phase_seconds.get(p, 0.0) for s in ts]), mean([s["phases"][p] for s in ps]))
        act = mean([s.activity_seconds for s in ts])
        wall = mean([s.step_seconds for s in ts])
        plain_wall = mean([s["wall"] for s in ps])
        row("sum of activity times", act, mean([sum(s["phases"].values()) for s in ps]))
        row("step wall (RLStep workflow)", wall, plain_wall)
        over = wall - act
        print(f"{'orchestration overhead':<30} {over:>10.3f}s {'':>11} {'':>7}  ({100 * over / wall:.1f}% of step wall)")
        row("step cadence (close-to-close)", cadence(tem["closes"]), plain_wall)
        print()
        print(f"ratio temporal / plain loop: {wall / plain_wall:.2f}x (RLStep wall), "
              f"{cadence(tem['closes']) / plain_wall:.2f}x (cadence incl. parent workflow between steps)")
        print()
        print(f"{'rollout.mode':<14} {'s/step':>8} {'/ plain':>8} {'overlap s':>10} {'staleness':>10} {'buffer':>7}")
        print(f"{'plain loop':<14} {plain_wall:>8.3f} {1.0:>7.2f}x {'-':>10} {'0':>10} {'-':>7}")
        for mode, r in runs.items():
            ss = [s for s in r["steps"] if s.step > 1]
            stale = mean([s.staleness for s in ss if s.rollout_version is not None])
            print(f"{mode:<14} {cadence(r['closes']):>8.3f} {cadence(r['closes']) / plain_wall:>7.2f}x "
                  f"{mean([s.overlap_seconds for s in ss]):>10.3f} {stale:>10.2f} "
                  f"{mean([s.buffer_depth for s in ss]):>7.2f}")
        final = read_meta(work / "store" / "runs" / RUN_ID / "weights" / f"v{cfg.steps:06d}").get("checksum")
        print(f"final weights v{cfg.steps}: temporal {str(final)[:12]} plain {plain['checksum'][:12]} "
              f"bitwise equal: {final == plain['checksum']}")
        print("notes: step 1 excluded (warm-up). Activity times are measured inside each activity; the overhead "
              "is Temporal scheduling + payloads + worker polling + node-agent -> trainer RPC. The stack's "
              "rollout runs chunks on 2 engine processes; the plain loop runs them one after another on 1 thread. "
              "Its 'train' is train_step only (no weight export / upload to the store); 'update_weights' is a "
              "load_state_dict into the generation copy.")


if __name__ == "__main__":
    main()
