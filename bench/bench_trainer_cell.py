"""Seconds per RL train step and peak memory per rank: the single trainer vs fsdp2 cells.

A random-init Qwen2-style model (``--hidden``/``--layers``, BPE tokenizer from the test
rows) trains ``--steps`` RL steps on fixed synthetic samples (``tests/unit``'s helpers):
once in this process with ``PolicyTrainer`` (the baseline) and once per rank count in
``--ranks`` as a ``TrainerCell`` (Ray actors, gloo, 1 torch thread each). Prints s/step
(median over steps after the first), the ratio to the baseline, each rank's peak RSS, and
what gloo's collectives cost per cell: the full state dict gathered for publication, one
all-gather and one reduce-scatter of the parameters' size, and the step's count of them.
On a 2-core machine the ranks share the cores, so the ratio shows the cost of the
collectives and the per-rank duplication of small work, not a speed-up.

    PYTHONPATH=. .venv/bin/python -m bench.bench_trainer_cell [--hidden 256 --layers 4 --steps 6 --ranks 1 2]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._tiny_model import add_model_args, tiny_base_folder  # noqa: E402
from gpu_runtime.trainer.policy.trainer import PolicyTrainer  # noqa: E402
from gpu_runtime.trainer.fsdp2.cell import TrainerCell, _Rank  # noqa: E402
from gpu_runtime.trainer.fsdp2.rank_methods import COLLECTIVE_SECONDS  # noqa: E402
from gpu_runtime.trainer.fsdp2.ray_runtime import RayRuntime  # noqa: E402
from tests.unit.test_policy_trainer import hparams, rollout  # noqa: E402


def timed(step) -> float:
    t0 = time.perf_counter()
    step()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_model_args(p)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    torch.set_num_threads(1)
    folder = tiny_base_folder(args, "bench-cell-")
    hp = hparams(micro_batch_size=4, ppo_epochs=1, kl_coef=0.0, warmup_steps=0)
    batches = [rollout(s, n_prompts=4, group=4) for s in range(1, args.steps + 1)]  # 16 samples, 4 micro-batches

    single = PolicyTrainer.create(folder, hp, 7)
    secs = [timed(partial(single.train_step, *b, 4, hp)) for b in batches]
    base = statistics.median(secs[1:])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    n_params = sum(p.numel() for p in single.model.parameters())
    print(f"model: {n_params / 1e6:.2f} M params; {args.steps} steps of 16 samples (4 micro-batches)")
    print(f"single       {base:.3f} s/step  1.00x  peak RSS {rss:.0f} MiB (this process)")
    del single
    rt = RayRuntime(num_cpus=max(args.ranks)).start()
    try:
        for n in args.ranks:
            cell = TrainerCell(n, folder, hp, 7)
            try:
                secs = [timed(partial(cell.train_step, *b, 4, hp)) for b in batches]
                med = statistics.median(secs[1:])
                peaks = cell._all(_Rank.peak_rss_mib)
                print(f"fsdp2 x{n}     {med:.3f} s/step  {med / base:.2f}x  peak RSS per rank "
                      + ", ".join(f"{m:.0f}" for m in peaks) + " MiB")
                c = cell._call(COLLECTIVE_SECONDS, 5)
                t = timed(cell.published_state)  # gather on rank 0 + the Ray transfer to this process
                per_step = 4 // n * hp.ppo_epochs  # micro-batches per rank: each forward + backward
                print(f"  gloo, {c['param_mib']:.1f} MiB of float32 params: full state dict gather (publication) "
                      f"{c['gather_state_dict'] * 1e3:.1f} ms (+ to the driver {t * 1e3:.0f} ms); one all-gather "
                      f"{c['all_gather'] * 1e3:.1f} ms, one reduce-scatter {c['reduce_scatter'] * 1e3:.1f} ms; per step "
                      f"{per_step} micro-batches x (2 all-gathers + 1 reduce-scatter) ~ "
                      f"{per_step * (2 * c['all_gather'] + c['reduce_scatter']) * 1e3:.0f} ms")
            finally:
                cell.close()
    finally:
        rt.stop()


if __name__ == "__main__":
    main()
