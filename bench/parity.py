"""Learning parity: Milestone against the plain single-process reference loop.

For each seed, the same base model folder (``bench.plain_grpo.make_model_folder``:
a BPE tokenizer on the train rows + a random-init transformers model), the same
train rows (``generate_arithmetic(n_train, seed)``, which is what a Milestone run
of that seed prepares) and the same held-out rows go through

- ``bench.plain_grpo`` (one process, transformers, no Temporal), and
- a Milestone run on a real stack (Temporal dev server, control worker, node agent
  with its trainer and 2 engine processes) with ``model.path`` = that folder and the
  same settings.

With ``--rl-only`` the plain loop's SFT runs once and both sides start GRPO from
those weights (SFT 0 steps on each side), which isolates the RL part from the SFT
part's seed-to-seed variance. Held-out greedy accuracy is measured on both sides by the same function
(``plain_grpo.greedy_accuracy``) on the post-SFT and final weights (Milestone's are
read from its store). Prints per seed: seconds per RL step and their ratio, the
mean reward of the first and last 20 RL steps, held-out accuracy after SFT and after RL.

    .venv/bin/python -m bench.parity [--seeds 0 1 2] [--rl-steps 150] [--json out.json]

The issue's settings are the defaults: hidden 256, intermediate 1024, 4 layers, 4
heads, 4 kv heads; SFT 300 x 64 at 3e-4 (no clipping); GRPO 16 prompts x 8
samples, lr 3e-5, clip 0.2, KL 0, grad clip 1.0, one optimizer step per rollout,
6 new tokens, temperature 1. A full run takes about 8 minutes per seed on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import plain_grpo  # noqa: E402
from gpu_runtime.models.hf_factory import save_hf_folder  # noqa: E402
from tests.e2e.faults import progress, run_to_end  # noqa: E402
from tests.stack import Stack  # noqa: E402
from workers.common import connect  # noqa: E402

log = logging.getLogger("parity")
N_TRAIN, N_HELDOUT = 2000, 500
MIN_OPERAND, MAX_OPERAND = 10, 99  # 2-digit addition: every prompt is DD+DD=


def milestone_config(seed: int, folder: Path, store: Path, a: argparse.Namespace) -> dict:
    return {
        "name": f"parity-s{seed}", "seed": seed, "steps": a.rl_steps, "store": f"file://{store}",
        "model": {"path": str(folder)},
        "data": {"kind": "arithmetic", "num_train": N_TRAIN, "min_operand": MIN_OPERAND,
                 "max_operand": MAX_OPERAND, "ops": "+"},
        "sft": {"steps": a.sft_steps, "batch_size": 64, "lr": 3e-4},
        "rollout": {"prompts_per_step": 16, "group_size": 8, "chunk_size": 32, "max_new_tokens": 6,
                    "temperature": 1.0},
        "train": {"lr": 3e-5, "clip_eps": 0.2, "kl_coef": 0.0, "grad_clip": 1.0, "ppo_epochs": 1},
        "checkpoint": {"every": 50, "keep_last": 2},
        "engines": {"num_engines": 2},
    }


def heldout_accuracy(folder: Path, heldout: list[dict]) -> float:
    model, tok = plain_grpo.load_policy(folder)
    return plain_grpo.greedy_accuracy(model.eval(), tok, heldout, max_new_tokens=6)


def run_milestone(seed: int, folder: Path, heldout: list[dict], work: Path, a: argparse.Namespace) -> dict:
    store = work / "store"
    cfg = milestone_config(seed, folder, store, a)
    run_id = cfg["name"]
    stack = Stack(work / "stack")
    try:
        stack.start()

        async def main() -> list:
            client = await connect(stack.server.address)
            await run_to_end(client, run_id, cfg, timeout_s=7200)
            return (await progress(client, run_id)).steps

        t0 = time.monotonic()
        steps = asyncio.run(main())
        wall = time.monotonic() - t0
    finally:
        stack.stop()
    weights = store / "runs" / run_id / "weights"
    rewards = [s.reward_mean for s in steps]
    k = min(20, len(rewards))
    return {
        "rl_s_per_step": statistics.fmean(s.step_seconds for s in steps[1:] or steps),
        "reward_first20": statistics.fmean(rewards[:k]), "reward_last20": statistics.fmean(rewards[-k:]),
        "heldout_acc_sft": heldout_accuracy(weights / "v000000", heldout),
        "heldout_acc_rl": heldout_accuracy(weights / f"v{len(steps):06d}", heldout),
        "wall_s": wall, "rewards": rewards,
    }


def shared_sft_folder(folder: Path, train: list[dict], seed: int, a: argparse.Namespace, out: Path) -> Path:
    """``--rl-only``: one post-SFT model (the plain loop's SFT) that both sides start RL from."""
    model, tok = plain_grpo.load_policy(folder)
    plain_grpo.sft(model, tok, train, steps=a.sft_steps, batch_size=64, lr=3e-4, seed=seed)
    return save_hf_folder(model.eval(), tok, out)


def run_seed(seed: int, a: argparse.Namespace, root: Path) -> dict:
    work = root / f"seed-{seed}"
    train, heldout = plain_grpo.split_rows(N_TRAIN, N_HELDOUT, seed, MAX_OPERAND, MIN_OPERAND)
    plain_args = ["--seed", str(seed), "--rl-steps", str(a.rl_steps), "--sft-steps", str(a.sft_steps),
                  "--n-train", str(N_TRAIN), "--n-heldout", str(N_HELDOUT), "--min-operand", str(MIN_OPERAND),
                  "--max-operand", str(MAX_OPERAND), "--log-every", "50"]
    folder = plain_grpo.make_model_folder(work / "model", train, plain_grpo.parse_args(plain_args))
    if a.rl_only:  # both sides: GRPO from the same post-SFT weights, no SFT of their own
        folder = shared_sft_folder(folder, train, seed, a, work / "sft")
        plain_args[plain_args.index("--sft-steps") + 1] = "0"
        a = argparse.Namespace(**{**vars(a), "sft_steps": 0})
    print(f"\n=== seed {seed}: plain loop", flush=True)
    plain = plain_grpo.main([*plain_args, "--model", str(folder)])
    print(f"=== seed {seed}: Milestone run", flush=True)
    ours = run_milestone(seed, folder, heldout, work, a)
    return {"seed": seed, "plain": plain, "milestone": ours}


def report(results: list[dict]) -> None:
    print("\nper seed                          plain  Milestone   ratio / diff")
    for r in results:
        p, m = r["plain"], r["milestone"]
        print(f"seed {r['seed']}")
        print(f"  seconds per RL step            {p['rl_s_per_step']:6.3f}     {m['rl_s_per_step']:6.3f}   "
              f"{m['rl_s_per_step'] / p['rl_s_per_step']:.2f}x")
        for label, key in (("reward, first 20 steps", "reward_first20"), ("reward, last 20 steps", "reward_last20"),
                           ("held-out greedy acc after SFT", "heldout_acc_sft"),
                           ("held-out greedy acc after RL", "heldout_acc_rl")):
            print(f"  {label:30} {p[key]:6.3f}     {m[key]:6.3f}   {m[key] - p[key]:+.3f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rl-steps", type=int, default=150)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--rl-only", action="store_true",
                    help="run the plain loop's SFT once and start both sides' GRPO from those weights")
    ap.add_argument("--json", type=Path, help="write every number here")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="parity-") as tmp:
        results = [run_seed(seed, a, Path(tmp)) for seed in a.seeds]
    report(results)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
