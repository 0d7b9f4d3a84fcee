"""Training stall per checkpoint: async upload vs synchronous save+upload.

For a ~10 MB and a ~50 MB state (safetensors weights + optimizer + json), to a local
dir and to a real SeaweedFS, measures how long ``CheckpointStore.save`` blocks the
trainer with ``sync=False`` (copy + hash, upload in the background) and ``sync=True``
(copy + hash + upload + verify + manifest). Every checkpoint changes the tensors, so
nothing is skipped as unchanged except the tokenizer file.

    .venv/bin/python -m bench.bench_checkpoint [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from gpu_runtime.store.checkpoint_store import CheckpointStore
from gpu_runtime.store.s3 import S3Store
from gpu_runtime.store.object_store import LocalStore, ObjectStore
from infra.seaweedfs import SeaweedServer

log = logging.getLogger("bench_checkpoint")
MB = 1 << 20


def write_state(folder: Path, total_mb: int, step: int) -> None:
    """Weights (1/3) + Adam moments (2/3) in fp32, changed every step."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(step)
    n = total_mb * MB // 4 // 3
    save_file({"w": torch.randn(n, generator=g)}, str(folder / "model.safetensors"))
    save_file({"m": torch.randn(n, generator=g), "v": torch.rand(n, generator=g)}, str(folder / "optimizer.safetensors"))
    (folder / "trainer_state.json").write_text(json.dumps({"step": step, "rng": [1, 2, 3]}))
    (folder / "tokenizer.json").write_text("{}" * 1000)


def measure(store: ObjectStore, work: Path, total_mb: int, sync: bool, repeats: int) -> list[float]:
    tag = "sync" if sync else "async"
    cs = CheckpointStore(store, f"bench-{total_mb}mb-{tag}", work / f"local-{total_mb}-{tag}", keep_last=2)
    stalls = []
    for step in range(1, repeats + 1):
        folder = work / f"state-{total_mb}-{step}"
        write_state(folder, total_mb, step)  # the trainer's own write: same in both modes
        t0 = time.perf_counter()
        handle = cs.save(step, folder, {"step": step}, sync=sync)
        stalls.append(time.perf_counter() - t0)
        if not handle.wait(300):  # stands in for training time before the next save
            raise RuntimeError(f"checkpoint {step} not durable: {handle.error}")
    cs.close()
    return stalls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 50], help="state sizes in MB")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        work = Path(tmp)
        with SeaweedServer(work / "seaweedfs") as srv:
            stores: dict[str, ObjectStore] = {
                "local": LocalStore(work / "store"),
                "seaweedfs": S3Store("bench", "", endpoint_url=srv.endpoint_url,
                                     access_key=srv.access_key, secret_key=srv.secret_key),
            }
            print(f"{'target':<10} {'state':>6} {'async stall':>12} {'sync stall':>11} {'ratio':>7}")
            for name, store in stores.items():
                for mb in args.sizes:
                    a = statistics.median(measure(store, work / name, mb, False, args.repeats))
                    s = statistics.median(measure(store, work / name, mb, True, args.repeats))
                    print(f"{name:<10} {mb:>4}MB {a * 1e3:>10.1f}ms {s * 1e3:>9.1f}ms {s / a:>6.1f}x", flush=True)
    print(f"(median of {args.repeats} checkpoints each; stall = time save() blocks the trainer)")


if __name__ == "__main__":
    main()
