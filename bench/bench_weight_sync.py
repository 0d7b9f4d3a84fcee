"""Weight push on one node: the store path (model folder on disk) vs a shared-memory
segment vs a torch.distributed broadcast.

For one random Qwen2-shaped model, times what a version costs to hand from the trainer
to an engine on the same node, in the three ways ``engines.weight_sync`` offers:

- ``store``: the trainer writes the version's folder (``save_model_folder``: hash +
  safetensors), the engine loads it (``load_weights_into``) and re-hashes its weights;
- ``shared_memory``: the trainer writes a ``/dev/shm`` segment (``publish``: hash +
  copy), the engine maps it, verifies its bytes against the header's checksum, loads it
  (``load_into``) and re-hashes its weights;
- ``distributed``: trainer (rank 0, this thread) and engine (rank 1, another thread of
  this process, as a real engine's HTTP thread would) join a fresh group (gloo; NCCL with
  ``--device cuda``), the trainer broadcasts every tensor, the engine verifies the
  received bytes' checksum, loads them and re-hashes its weights (what
  ``/update_weights_from_distributed`` does). The group is formed per push, as the fleet does.

Write and read sides are reported apart (the fleet path publishes once per node and
every engine reads), with GB/s over the weights' bytes and the ratio disk / shm. The
engine's re-hash after a load (the fleet's checksum gate) is the same in both and shown
separately. ``--device cuda`` puts the engine-side model on the GPU.

    .venv/bin/python -m bench.bench_weight_sync [--hidden 896 --layers 24] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import statistics
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import torch

from bench._shape_cli import run_shape_bench
from gpu_runtime.models.causal_lm import export_state_dict
from gpu_runtime.models.hf_factory import build_hf_model, train_bpe_tokenizer
from gpu_runtime.models.model_folder import load_weights_into, model_checksum, save_model_folder
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.models.causal_lm import load_exported_state_dict
from gpu_runtime.models.model_folder import weights_checksum
from gpu_runtime.proc.processes import free_port
from gpu_runtime.weight_sync import shared_memory as shm
from gpu_runtime.weight_sync.distributed import DEFAULT_BUCKET_BYTES, GroupSpec, WeightGroup, manifest_of


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(*, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, repeats: int,
            device: str = "cpu", work: Path | None = None) -> dict:
    tok = train_bpe_tokenizer(["the quick brown fox jumps over the lazy dog 0123456789 +-*/="] * 20, 300)
    args = dict(arch="qwen2", hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                tokenizer=tok, tie_word_embeddings=True)
    trainer = build_hf_model(**args, seed=1)
    engine = build_hf_model(**args, seed=2).to(device)
    tokenizer = Tokenizer(tok)
    sd = export_state_dict(trainer)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    work = Path(work or tempfile.mkdtemp(prefix="bench-ws-"))
    rows: dict[str, list[float]] = {k: [] for k in ("disk_write", "disk_read", "shm_write", "shm_read", "rehash",
                                                      "dist_join", "dist_broadcast", "dist_load",
                                                      "dist_broadcast_per_tensor")}
    expected = model_checksum(trainer)
    for r in range(repeats):
        folder = work / f"v{r}"
        rows["disk_write"].append(_timed(partial(save_model_folder, trainer, tokenizer, folder, weight_version=r)))
        rows["disk_read"].append(_timed(partial(load_weights_into, engine, folder)))
        rows["rehash"].append(_timed(partial(model_checksum, engine)))
        box: dict = {}
        rows["shm_write"].append(_timed(lambda box=box, r=r: box.update(seg=shm.publish(sd, r, tag="bench",
                                                                                         checksum=expected))))
        rows["shm_read"].append(_timed(lambda box=box, r=r: shm.load_into(engine, box["seg"].path, version=r,
                                                                           checksum=expected)))
        assert model_checksum(engine) == expected
        shm.prune(shm.DEFAULT_ROOT, "bench", keep=set())
        for k, v in _distributed_push(sd, engine, expected, device, f"bench-{r}").items():
            rows[k].append(v)
        per_tensor = _distributed_push(sd, engine, expected, device, f"bench-pt-{r}", bucket_bytes=0)
        rows["dist_broadcast_per_tensor"].append(per_tensor["dist_broadcast"])
        assert model_checksum(engine) == expected
    med = {k: statistics.median(v) for k, v in rows.items()}
    gb = nbytes / 1e9
    out = {
        "params_m": round(sum(t.numel() for t in sd.values()) / 1e6, 1), "weights_gb": round(gb, 3),
        "device": device, "repeats": repeats, "shm_root": str(shm.DEFAULT_ROOT),
    }
    for k, v in med.items():
        out[f"{k}_ms"] = round(v * 1000, 1)
        if k != "dist_join":  # a join moves no weights
            out[f"{k}_gb_s"] = round(gb / v, 2)
    out["write_ratio_disk_over_shm"] = round(med["disk_write"] / med["shm_write"], 2)
    out["read_ratio_disk_over_shm"] = round(med["disk_read"] / med["shm_read"], 2)
    out["push_ms_store"] = round((med["disk_write"] + med["disk_read"] + med["rehash"]) * 1000, 1)
    out["push_ms_shared_memory"] = round((med["shm_write"] + med["shm_read"] + med["rehash"]) * 1000, 1)
    dist = med["dist_join"] + med["dist_broadcast"] + med["dist_load"]
    out["dist_backend"] = "nccl" if device.startswith("cuda") else "gloo"
    out["push_ms_distributed"] = round((dist + med["rehash"]) * 1000, 1)
    out["dist_broadcast_gb_s"] = round(gb / med["dist_broadcast"], 2)
    out["dist_bucket_mb"] = DEFAULT_BUCKET_BYTES // 2**20
    out["dist_ratio_per_tensor_over_bucketed"] = round(med["dist_broadcast_per_tensor"] / med["dist_broadcast"], 2)
    store_push = out["push_ms_store"]
    out["table"] = [
        {"mode": m, "push_ms": out[f"push_ms_{m}"], "push_gb_s": round(gb / (out[f"push_ms_{m}"] / 1000), 2),
         "speedup_vs_store": round(store_push / out[f"push_ms_{m}"], 2)}
        for m in ("store", "shared_memory", "distributed")
    ]
    return out


def _distributed_push(sd: dict[str, torch.Tensor], engine: torch.nn.Module, expected: str, device: str,
                      group_name: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, float]:
    """One per-push group: join, broadcast, then the engine's verify + load (its re-hash is
    timed apart, as for the other modes). ``bucket_bytes`` 0: a broadcast per tensor, as
    for SGLang engines; the fleet packs tensors for torch engines."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    manifest = manifest_of(sd).with_buckets(bucket_bytes)
    spec = GroupSpec("127.0.0.1", free_port(), 2, group_name, backend)
    box: dict = {}
    joined = threading.Barrier(2)

    def engine_side() -> None:
        g = WeightGroup(spec, 1, timeout_s=120)
        joined.wait()
        try:
            t0 = time.perf_counter()
            got = g.receive(manifest, device)
            box["recv"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            if weights_checksum(got) != expected:
                raise AssertionError("received weights do not hash to the trainer's checksum")
            with torch.no_grad():
                load_exported_state_dict(engine, got)
            if torch.cuda.is_available() and device.startswith("cuda"):
                torch.cuda.synchronize()
            box["load"] = time.perf_counter() - t1
        finally:
            g.close()

    t = threading.Thread(target=engine_side)
    t.start()
    t0 = time.perf_counter()
    g0 = WeightGroup(spec, 0, timeout_s=120)
    join_s = time.perf_counter() - t0
    joined.wait()
    src = {k: v.to(device) for k, v in sd.items()} if backend == "nccl" else sd
    try:
        g0.send(src, manifest)
    finally:
        t.join()
        g0.close()
    return {"dist_join": join_s, "dist_broadcast": box["recv"], "dist_load": box["load"]}


def main() -> None:
    run_shape_bench(__doc__, measure, hidden=512, intermediate=1536, layers=8, heads=8, kv_heads=2, repeats=3)


if __name__ == "__main__":
    main()
