"""What losing a DP cell costs (``trainer.cells: 2``) against what a trainer crash costs.

The demo model (examples/demo.yaml, SFT cut to ``--sft-steps``) trains ``--steps`` RL steps
in-process through ``TrainerService`` as the node's trainer process runs them: rollouts by
``generate_batch`` over the real chunk plan on the step's published weights, rewards by
``score_samples``, real DP cell processes and a real torchft lighthouse.

- At step ``--kill-step`` cell 1 is SIGKILLed ``--kill-after`` seconds into the step:
  **survivor stall** = that step's train seconds - the median 2-cell step.
- At step ``--restart-step`` cell 1 is restarted (``restart_cells``, what the workflow's
  heal runs; its process starts in the background, and here the bench waits until it is up
  to time it) and heals from cell 0 in that step:
  **heal step extra** = that step's train seconds - the median 2-cell step; the two cells'
  weight + AdamW checksums are compared after it.
- The baseline is a trainer crash with checkpoints every ``--interval`` steps: a fresh
  single-process ``TrainerService`` restores the newest checkpoint and replays the stored
  steps since (``bench/bench_restore.py``), at the worst crash point (k-1 steps replayed).

    .venv/bin/python -m bench.bench_dp_cells [--steps 8] [--interval 4]
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._inproc import demo_config, dataset_rows, generate_step, rollout_request, run_setup, step_batch  # noqa: E402
from bench.bench_restore import build_run, fresh_ensure  # noqa: E402
from gpu_runtime.data.rewards import score_samples  # noqa: E402
from gpu_runtime.models.causal_lm import load_causal_lm  # noqa: E402
from gpu_runtime.models.tokenizer import Tokenizer  # noqa: E402
from gpu_runtime.store import artifacts as art  # noqa: E402
from gpu_runtime.store.object_store import LocalStore  # noqa: E402
from gpu_runtime.trainer.service import TrainerService  # noqa: E402

RUN_ID = "bench-dp"


def dp_run(cfg, setup, work: Path, kill_step: int, kill_after: float, restart_step: int) -> dict[str, object]:
    store = LocalStore(work / "store")
    rows = dataset_rows(cfg, work / "train.jsonl")
    store.put_file(setup.dataset_key, work / "train.jsonl")
    spec = cfg.reward
    svc = TrainerService(work / "dp")
    by_index = dict(enumerate(rows))
    out: dict[str, object] = {"steps": {}}
    try:
        info = svc.ensure_version(setup, 0)
        folder = Path(info.model_path)
        for step in range(1, cfg.steps + 1):
            if step == restart_step:
                t = time.perf_counter()
                res = svc.restart_cells(setup, [1])
                assert res.outcome == {"1": "restarting"}, res.outcome
                group = svc.layouts.dp_group
                assert group is not None
                while group.members[1].state != "alive":  # a bench: time it to the moment it is up
                    assert group.members[1].state == "starting", group.members[1].why
                    time.sleep(0.01)
                out["restart_s"] = time.perf_counter() - t
            tok = Tokenizer.load(folder)
            chunks = generate_step(load_causal_lm(folder).eval(), rollout_request(cfg, RUN_ID, step, len(rows)), rows, tok)
            keys = []
            for c in chunks:
                keys.append(art.rollout_chunk_key(RUN_ID, step, c.chunk))
                art.put_model(store, keys[-1], c)
            samples = [s for c in chunks for s in c.samples]
            rkey = art.rewards_key(RUN_ID, step)
            art.put_model(store, rkey, art.StepRewards(run_id=RUN_ID, step=step, rewards=score_samples(samples, by_index, spec)))
            killer = None
            if step == kill_step:
                assert svc.layouts.dp_group is not None
                pid = svc.layouts.dp_group.members[1].pid
                assert pid is not None
                killer = threading.Timer(kill_after, os.kill, (pid, signal.SIGKILL))
                killer.start()
            res = svc.train_step(setup, step_batch(cfg, RUN_ID, step, keys, rkey))
            if killer is not None:
                killer.join()
            folder = svc._weights_dir(res.policy_version)
            dp = res.dp
            assert dp is not None
            out["steps"][step] = (res.seconds, res.metrics["dp_cells"], [c.state for c in dp.cells])
            print(f"  step {step:>2}: {res.seconds:.3f} s train, {int(res.metrics['dp_cells'])} cell(s), "
                  f"{[c.state for c in dp.cells]}, checksums equal "
                  f"{len({c.state_checksum for c in dp.cells if c.state == 'alive'}) == 1}", flush=True)
        dp = svc.dp_state()
        assert dp is not None
        out["bitwise"] = dp.cells[0].state_checksum == dp.cells[1].state_checksum
    finally:
        svc.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sft-steps", type=int, default=50)
    ap.add_argument("--kill-step", type=int, default=3)
    ap.add_argument("--kill-after", type=float, default=0.15, help="seconds into the kill step's train call")
    ap.add_argument("--restart-step", type=int, default=5)
    ap.add_argument("--interval", type=int, default=4, help="the crash baseline's checkpoint interval k")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-dp-") as tmp:
        work = Path(tmp)
        def config(where: Path):
            return demo_config(where / "store", steps=args.steps, sft_steps=args.sft_steps, every=1, keep_last=1000,
                               name=RUN_ID)

        cfg = config(work / "single-run")
        setup = run_setup(cfg, RUN_ID)
        dp_cfg = config(work / "dp-run")
        dp_setup = run_setup(dp_cfg.model_copy(update={"trainer": dp_cfg.trainer.model_copy(update={"cells": 2})}),
                             RUN_ID)
        print(f"DP run: demo model, {cfg.samples_per_step} samples/step, 2 cells; cell 1 killed "
              f"{args.kill_after}s into step {args.kill_step}, restarted at step {args.restart_step}", flush=True)
        r = dp_run(dp_cfg, dp_setup, work / "dp-run", args.kill_step, args.kill_after, args.restart_step)
        steps = r["steps"]
        two = [s for k, (s, n, _) in steps.items() if n == 2 and k not in (1, args.restart_step)]
        one = [s for k, (s, n, _) in steps.items() if n == 1 and k != args.kill_step]
        two_med = statistics.median(two)
        stall = steps[args.kill_step][0] - two_med
        heal_extra = steps[args.restart_step][0] - two_med

        print("crash baseline: the same run on one trainer process, checkpoint every step, restored at interval "
              f"{args.interval}", flush=True)
        build_run(cfg, setup, work / "single-run")
        k, v = args.interval, 2 * args.interval - 1  # worst crash point: k-1 steps to replay
        v = min(v, cfg.steps)
        c = (v // k) * k
        meas = work / "measure"
        meas.mkdir()
        fresh_ensure(setup, meas, k, v, "warmup")
        info_r, _ = fresh_ensure(setup, meas, k, c, "restore")
        info_t, _ = fresh_ensure(setup, meas, k, v, "replay")
        crash_worst = info_t.seconds
        per_step = (info_t.seconds - info_r.seconds) / max(v - c, 1)
        crash_mean = info_r.seconds + per_step * (k - 1) / 2

        print()
        print(f"{'what':<58} {'seconds':>8}")
        print(f"{'2-cell train step (median of ' + str(len(two)) + ')':<58} {two_med:>8.3f}")
        print(f"{'1-cell train step (median of ' + str(len(one)) + ')':<58} {statistics.median(one) if one else float('nan'):>8.3f}")
        print(f"{'survivor stall: kill step - 2-cell median':<58} {stall:>8.3f}")
        print(f"{'cell restart to alive (background: no step waits for it)':<58} {r['restart_s']:>8.3f}")
        print(f"{'heal step extra: heal step - 2-cell median':<58} {heal_extra:>8.3f}")
        print(f"{'trainer crash, k=' + str(k) + ': restore + replay ' + str(v - c) + ' steps (worst)':<58} {crash_worst:>8.3f}")
        print(f"{'trainer crash, k=' + str(k) + ': restore + replay (k-1)/2 steps (mean)':<58} {crash_mean:>8.3f}")
        print(f"cell loss vs crash (worst): {stall + heal_extra:.3f} s vs {crash_worst:.3f} s "
              f"({crash_worst / max(stall + heal_extra, 1e-9):.1f}x less on the step path); "
              f"healed cell bitwise equal to its peer: {r['bitwise']}")


if __name__ == "__main__":
    main()
