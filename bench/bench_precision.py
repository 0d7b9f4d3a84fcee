"""Seconds per train step with ``train.precision`` fp32 vs bf16, side by side.

A random-init Qwen2-style model (``--hidden``/``--layers``, BPE tokenizer from the test
rows) trains ``--steps`` RL steps (GRPO, 16 samples in 4 micro-batches, one epoch) and
as many SFT steps (16 rows) on fixed inputs, once per precision, with ``PolicyTrainer``
as the trainer process runs it. The two precisions alternate step by step (each on its
own trainer), so a neighbour's load on a shared machine hits both alike. Prints the
median s/step after the first step of each and the ratio bf16 / fp32.

On CPU, bf16 autocast pays a cast per matmul input and gains only where the CPU has native
bf16 matmuls (AVX512-BF16 / AMX), and the small matmuls of a tiny model gain little: expect
a ratio near 1 either way (measured in docs/trainer-backends.md). On a GPU (``--device cuda``)
bf16 matmuls run on tensor cores; the master weights and AdamW stay float32 either way.

    PYTHONPATH=. .venv/bin/python -m bench.bench_precision [--hidden 256 --layers 4 --steps 6 --device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._tiny_model import add_model_args, tiny_base_folder  # noqa: E402
from gpu_runtime.trainer.policy.trainer import PolicyTrainer  # noqa: E402
from tests.unit.test_policy_trainer import ROWS, hparams, rollout  # noqa: E402

PRECISIONS = ("fp32", "bf16")


def timed(step) -> float:
    if torch.cuda.is_available() and torch.get_default_device().type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    if torch.cuda.is_available() and torch.get_default_device().type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (as the trainer process's --device)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    if args.device != "cpu":
        import os

        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        from gpu_runtime.trainer.common.device import use_device

        use_device(args.device)
    folder = tiny_base_folder(args, "bench-precision-")
    hps = {pr: hparams(micro_batch_size=4, ppo_epochs=1, kl_coef=0.0, warmup_steps=0, precision=pr)
           for pr in PRECISIONS}
    batches = [rollout(s, n_prompts=4, group=4) for s in range(1, args.steps + 1)]
    rows = [ROWS[16 * (s % 2): 16 * (s % 2) + 16] for s in range(args.steps)]  # 16 rows per SFT step
    trainers = {pr: PolicyTrainer.create(folder, hps[pr], 7) for pr in PRECISIONS}
    n_params = sum(q.numel() for q in trainers["fp32"].model.parameters())
    rl: dict[str, list[float]] = {pr: [] for pr in PRECISIONS}
    sft: dict[str, list[float]] = {pr: [] for pr in PRECISIONS}
    for b in batches:
        for pr in PRECISIONS:
            rl[pr].append(timed(partial(trainers[pr].train_step, *b, 4, hps[pr])))
    for r in rows:
        for pr in PRECISIONS:
            sft[pr].append(timed(partial(trainers[pr].sft_step, r, hps[pr])))
    print(f"model: {n_params / 1e6:.2f} M params on {args.device}, {args.threads} thread(s); {args.steps} steps each")
    print(f"{'':10s} {'fp32 s/step':>12s} {'bf16 s/step':>12s} {'bf16/fp32':>10s}")
    for name, secs in (("RL step", rl), ("SFT step", sft)):
        a, b = statistics.median(secs["fp32"][1:]), statistics.median(secs["bf16"][1:])
        print(f"{name:10s} {a:12.3f} {b:12.3f} {b / a:9.2f}x")


if __name__ == "__main__":
    main()
