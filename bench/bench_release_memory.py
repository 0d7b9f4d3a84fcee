"""What ``engines.release_memory`` costs per step, against a weight update from disk.

For one random Qwen2-shaped model (default: the demo's, examples/demo.yaml), times on one
engine (``EngineState``, in process, the routes' own functions):

- ``release``: ``/release_memory_occupation`` (weights copied to their host buffers);
- ``resume_copy``: the copy back to the device alone; ``resume``: the whole route, which
  also re-hashes the weights against the engine's checksum;
- ``update_from_disk``: ``/update_weights_from_disk`` of the same version (safetensors
  load + re-hash): the baseline every step pays anyway;

and on the trainer's side one AdamW's state (after a step) parked on the host and back
(``OptimizerOffload``). Prints medians in ms and each phase switch over the baseline.
On the CPU nothing is freed (the copies are what is measured); ``--device cuda`` moves
real device memory and also reports the bytes ``torch.cuda.memory_allocated`` drops by.

    .venv/bin/python -m bench.bench_release_memory [--hidden 256 --layers 4] [--repeats 5] [--device cpu]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench._shape_cli import run_shape_bench
from gpu_runtime.engine.memory_occupation import release_route, resume_route
from gpu_runtime.engine.server import EngineState
from gpu_runtime.models.hf_factory import build_hf_model, train_bpe_tokenizer
from gpu_runtime.models.model_folder import save_model_folder
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.trainer.common.offload import OptimizerOffload


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0


def measure(*, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, repeats: int,
            device: str = "cpu") -> dict:
    tok = train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog 0123456789 +-*/="] * 20, 300)
    model = build_hf_model(arch="qwen2", hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                           tokenizer=tok, tie_word_embeddings=True, seed=1)
    folder = Path(tempfile.mkdtemp(prefix="bench-release-")) / "v1"
    save_model_folder(model, Tokenizer(tok), folder, weight_version=1)
    engine = EngineState(str(folder), None, device=device)
    nbytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    rows: dict[str, list[float]] = {k: [] for k in ("release", "resume", "resume_copy", "update_from_disk",
                                                    "optimizer_offload", "optimizer_onload")}
    freed: list[int] = []
    for _ in range(repeats):
        before = _allocated()
        rows["release"].append(_timed(lambda: release_route(engine, {})))
        freed.append(before - _allocated())
        rows["resume"].append(_timed(lambda: resume_route(engine, {})))
        release_route(engine, {})
        rows["resume_copy"].append(_timed(lambda: engine.memory.resume(engine.model, ("weights", "kv_cache"))))
        rows["update_from_disk"].append(_timed(lambda: engine.update_weights_from_disk({"model_path": str(folder)})))
    # the trainer's side: one AdamW step's state (exp_avg, exp_avg_sq) parked on the host and back
    trained = build_hf_model(arch="qwen2", hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                             tokenizer=tok, tie_word_embeddings=True, seed=2).to(device)
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-4, foreach=False)
    for p in trained.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    off = OptimizerOffload()
    opt_bytes = 0
    for _ in range(repeats):
        before = _allocated()
        rows["optimizer_offload"].append(_timed(lambda: off.offload([opt])))
        opt_bytes = before - _allocated()
        rows["optimizer_onload"].append(_timed(off.onload))
    med = {k: statistics.median(v) for k, v in rows.items()}
    out: dict = {"device": device, "repeats": repeats, "weights_mb": round(nbytes / 1e6, 2),
                 "params_m": round(sum(p.numel() for p in engine.model.parameters()) / 1e6, 2)}
    out.update({f"{k}_ms": round(v * 1e3, 2) for k, v in med.items()})
    base = med["update_from_disk"]
    out["engine_switch_ms"] = round((med["release"] + med["resume"]) * 1e3, 2)
    out["engine_switch_over_update_from_disk"] = round((med["release"] + med["resume"]) / base, 2)
    out["trainer_switch_over_update_from_disk"] = round((med["optimizer_offload"] + med["optimizer_onload"]) / base, 2)
    if device.startswith("cuda"):
        out["engine_freed_mb"] = round(statistics.median(freed) / 1e6, 1)
        out["optimizer_freed_mb"] = round(opt_bytes / 1e6, 1)
    return out


def main() -> None:
    run_shape_bench(__doc__, measure, hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=4, repeats=5)


if __name__ == "__main__":
    main()
