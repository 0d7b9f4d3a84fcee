"""The one-shot device check behind ``bench/gpu_check.sh`` (and its CPU tiny mode).

On one GPU, with nothing downloaded: builds a Qwen2-0.5B-shaped model folder (24 layers,
hidden 896, 14 heads / 2 KV heads, random init, a BPE tokenizer trained here on arithmetic
text: 261 tokens, so 358M parameters — Qwen2-0.5B's body without its big embedding), then
runs the node's own parts the way a ``--device cuda`` node does — engine processes
(``gpu_runtime.engine.server --device cuda:0``) in an ``EngineFleet``, the
``PolicyTrainer`` on the GPU as its trainer process puts it (``use_device``) — without
Temporal (not on the lent image), and measures:

- generation tok/s (one batch through the fleet) and same-seed determinism (the batch
  again: identical tokens and logprobs);
- a few GRPO steps (rollout -> math reward -> ``train_step`` -> weight push), the train
  step time, and the push both ways (``store``: model folder + ``/update_weights_from_disk``;
  ``shared_memory``: ``/dev/shm`` segment; ``distributed``: broadcast from the trainer over a
  per-push group, gloo when colocated on one GPU, NCCL across GPUs) in ms and GB/s, every
  push checksum-gated;
- the same-seed bitwise check: the GRPO steps again from the same seed in a fresh
  trainer end on the same weight checksum;
- time to heal an engine: one engine SIGKILLed, detected by the fleet's health probes,
  restarted with the newest weights, healthy again;
- megatron-core (if importable): a GPTModel from the folder's weights, its logits vs
  the HF model's, then ``trainer.backend: megatron``'s trainer: a few GRPO steps (step 1
  vs the HF trainer's loss and grad norm), a publish, and the same-seed bitwise rerun;
  SGLang: reported as present or not (not run).

Each section records ``ok`` / ``skipped`` (with the reason) / ``failed`` (with the
error) into one JSON results file; a failed section does not stop the others.

    python -m bench.gpu_check [--out results.json] [--steps 3]     # on a GPU
    python -m bench.gpu_check --cpu --tiny --out r.json             # the CPU rehearsal (tests)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("gpu_check")

# Qwen2-0.5B's body (its 151k vocab is the local tokenizer's here)
FULL_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2)
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
NEEDED = ("torch", "transformers", "tokenizers", "safetensors", "pydantic", "httpx")
OPTIONAL = ("megatron.core", "sglang", "sglang_router", "temporalio")


class Results:
    """Sections in the order they ran, written to ``path`` after each one."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"sections": {}}

    def section(self, name: str, fn: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
        t0 = time.perf_counter()
        try:
            out = fn()
            entry = {"status": "ok", **(out or {})}
        except Skip as s:
            out, entry = None, {"status": "skipped", "reason": str(s)}
        except Exception as e:  # noqa: BLE001 - one section's failure is reported, the rest still run
            out, entry = None, {"status": "failed", "error": f"{type(e).__name__}: {e}",
                                "trace": traceback.format_exc()[-2000:]}
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        self.data["sections"][name] = entry
        print(f"[gpu_check] {name}: {entry['status']} "
              + json.dumps({k: v for k, v in entry.items() if k not in ("status", "trace")}), flush=True)
        self.write()
        return out

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2, default=str) + "\n")


class Skip(Exception):
    pass


def have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def environment(device: str) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "device": device,
                           "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    import transformers

    out["transformers"] = transformers.__version__
    out["optional"] = {m: have(m) for m in OPTIONAL}
    return out


def make_model(folder: Path, tiny: bool, seed: int) -> dict[str, Any]:
    from gpu_runtime.data.datasets import generate_arithmetic, prompt_text, sft_target
    from gpu_runtime.models.hf_factory import init_model_folder, train_bpe_tokenizer

    texts = [prompt_text(r) + sft_target(r) for r in generate_arithmetic(2000, seed, 99, "+-*")]
    tok = train_bpe_tokenizer(texts, 300 if tiny else 4096)
    shape = TINY_SHAPE if tiny else FULL_SHAPE
    init_model_folder(folder, arch="qwen2", **shape, max_position_embeddings=512, tokenizer=tok, seed=seed,
                      tie_word_embeddings=True, initializer_range=0.3 if tiny else 0.02)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        params = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    return {"params_m": round(params / 1e6, 1), "vocab": len(tok), **shape,
            "folder_mb": round(sum(p.stat().st_size for p in folder.iterdir()) / 2**20, 1)}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = "cpu" if args.cpu else "cuda:0"
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="gpu-check-")).resolve()
        self.results = Results(Path(args.out).resolve())
        self.base = self.work / "base"
        self.fleet: Any = None
        self.rows: list[dict] = []
        self.runs: list[dict[str, Any]] = []

    # ---------------------------------------------------------------- parts
    def start_fleet(self) -> dict[str, Any]:
        from gpu_runtime.engine.backends import TorchEngineBackend
        from gpu_runtime.engine.fleet import EngineFleet
        from gpu_runtime.engine.fleet_types import HealthConfig
        from gpu_runtime.proc.devices import plan_placement
        from gpu_runtime.proc.processes import free_port_block

        placement = plan_placement("cpu" if self.args.cpu else "cuda", 0 if self.args.cpu else 1)
        health = HealthConfig(interval_s=1.0, timeout_s=10.0, first_wait_s=300.0, failure_threshold=1)
        t0 = time.perf_counter()
        self.fleet = EngineFleet(TorchEngineBackend(threads=1, devices=placement.engines), self.args.engines,
                                 self.base, free_port_block(self.args.engines), self.work / "logs",
                                 health=health, weight_version=0)
        self.fleet.start()
        return {"engines": self.args.engines, "engine_devices": list(placement.engines),
                "start_s": round(time.perf_counter() - t0, 2)}

    def _prompts(self, step: int, n: int) -> tuple[list[int], list[list[int]]]:
        from gpu_runtime.data.datasets import encode_prompt, prompts_for_step
        from gpu_runtime.models.tokenizer import Tokenizer

        tok = Tokenizer.load(self.base)
        idx = prompts_for_step(len(self.rows), self.args.seed, step * n, n)
        return idx, [encode_prompt(tok, self.rows[i]) for i in idx]

    def generation(self) -> dict[str, Any]:
        _, prompts = self._prompts(0, self.args.prompts * self.args.group)
        sp = {"max_new_tokens": self.args.max_new_tokens, "temperature": 1.0, "sampling_seed": 11}
        self.fleet.generate_chunk(prompts[:2], {**sp, "max_new_tokens": 2})  # warm-up (CUDA context, kernels)
        t0 = time.perf_counter()
        out, _ = self.fleet.generate_chunk(prompts, sp)
        secs = time.perf_counter() - t0
        toks = sum(len(r["output_ids"]) for r in out)
        again, _ = self.fleet.generate_chunk(prompts, sp)
        same = ([r["output_ids"] for r in out] == [r["output_ids"] for r in again]
                and [r["meta_info"]["output_token_logprobs"] for r in out]
                == [r["meta_info"]["output_token_logprobs"] for r in again])
        if not same:
            raise AssertionError("the same batch with the same seed gave different tokens or logprobs")
        return {"batch": len(prompts), "tokens": toks, "seconds": round(secs, 3),
                "gen_tok_s": round(toks / secs, 1), "same_seed_same_tokens": same}

    def grpo(self, tag: str) -> dict[str, Any]:
        """``steps`` GRPO steps from the base weights in a fresh trainer; weights pushed both ways."""
        import torch

        from gpu_runtime.data.rewards import math_answer_reward
        from gpu_runtime.models.model_folder import model_checksum
        from gpu_runtime.store.artifacts import Sample
        from gpu_runtime.trainer.policy.trainer import PolicyTrainer
        from gpu_runtime.weight_sync import shared_memory as shm
        from spec.train import TrainSpec

        hp = TrainSpec(lr=1e-5, micro_batch_size=self.args.micro_batch)
        trainer = PolicyTrainer.create(self.base, hp, self.args.seed)
        self.fleet.update_weights(self.base, 0)  # every run starts the engines from the same weights
        step_s: list[float] = []
        sync: dict[str, list[float]] = {"store": [], "shared_memory": [], "distributed": []}
        nbytes = 0
        shm_error: str | None = None
        dist_error: str | None = None if tag == "run1" else "measured in the first run only (time budget)"
        rewards_mean = []
        for step in range(1, self.args.steps + 1):
            idx, prompts = self._prompts(step, self.args.prompts)
            batch = [p for p in prompts for _ in range(self.args.group)]
            sp = {"max_new_tokens": self.args.max_new_tokens, "temperature": 1.0, "sampling_seed": 1000 + step}
            out, _ = self.fleet.generate_chunk(batch, sp)
            samples, rewards = [], []
            for j, (p, r) in enumerate(zip(batch, out)):
                i = idx[j // self.args.group]
                resp = r["output_ids"] or [0]
                lps = [lp for lp, _, _ in r["meta_info"]["output_token_logprobs"]] or [0.0]
                samples.append(Sample(sample_id=f"s{step}-p{i}-g{j % self.args.group}", prompt_index=i,
                                      group_index=j % self.args.group, prompt_ids=p, response_ids=resp,
                                      logprobs=lps, weight_version=step - 1, finish_reason="length"))
                rewards.append(math_answer_reward(r["text"], self.rows[i])[0])
            rewards_mean.append(sum(rewards) / len(rewards))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.train_step(samples, rewards, self.args.group, hp)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            step_s.append(time.perf_counter() - t0)
            # the push, both ways, each gated on the trainer's checksum
            t0 = time.perf_counter()
            folder = self.work / tag / f"v{step:06d}"
            checksum = trainer.export_model_folder(folder)
            got = self.fleet.update_weights(folder, step, "store")
            sync["store"].append(time.perf_counter() - t0)
            self._gate(got, checksum, "store", step)
            nbytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
            if dist_error is None:
                t0 = time.perf_counter()
                try:
                    got = self.fleet.update_weights(folder, step, "distributed", self._broadcaster(trainer, step, checksum))
                    push = self.fleet.last_push
                    if push is None or push.failed:  # the fleet fell back to disk: not a broadcast
                        raise RuntimeError(f"broadcast failed: {push.failed if push else None}")
                    sync["distributed"].append(time.perf_counter() - t0)
                    self._gate(got, checksum, "distributed", step)
                except RuntimeError as err:
                    dist_error = str(err)
            if shm_error is None:
                t0 = time.perf_counter()
                try:
                    seg = shm.publish(trainer.published_state(), step, tag=f"gpucheck{os.getpid()}", checksum=checksum)
                except OSError as err:  # a small /dev/shm (containers: 64 MB): report it, train on
                    shm_error = str(err)
                    continue
                got = self._push_segment(seg, step)
                sync["shared_memory"].append(time.perf_counter() - t0)
                self._gate(got, checksum, "shared_memory", step)
                shm.prune(shm.DEFAULT_ROOT, f"gpucheck{os.getpid()}", keep=set())
        final = model_checksum(trainer.model)
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        gb = nbytes / 1e9
        med = {k: sorted(v)[len(v) // 2] for k, v in sync.items() if v}
        res: dict[str, Any] = {
            "steps": self.args.steps, "samples_per_step": self.args.prompts * self.args.group,
            "train_step_s": [round(x, 3) for x in step_s], "reward_mean": rewards_mean,
            "weights_mb": round(nbytes / 2**20, 2),
            "sync_store_ms": round(med["store"] * 1000, 1), "sync_store_gb_s": _sig(gb / med["store"])}
        if "shared_memory" in med:
            res.update(sync_shm_ms=round(med["shared_memory"] * 1000, 1), sync_shm_gb_s=_sig(gb / med["shared_memory"]),
                       sync_ratio_store_over_shm=round(med["store"] / med["shared_memory"], 2))
        else:
            res["sync_shm_error"] = shm_error
        if "distributed" in med:
            res.update(sync_dist_ms=round(med["distributed"] * 1000, 1), sync_dist_gb_s=_sig(gb / med["distributed"]),
                       sync_ratio_store_over_dist=round(med["store"] / med["distributed"], 2),
                       sync_dist_backend=self._dist_backend())
        else:
            res["sync_dist_error"] = dist_error
        return {**res, "final_checksum": final}

    def _dist_backend(self) -> str:
        from gpu_runtime.weight_sync.distributed import group_backend

        return group_backend(self.device, list(getattr(self.fleet.backend, "devices", ("cpu",))))

    def _broadcaster(self, trainer: Any, version: int, checksum: str) -> Any:
        """The in-process trainer as rank 0 of each push's group (a node's trainer process
        does the same through its ``broadcast_weights`` RPC)."""
        from gpu_runtime.weight_sync.distributed import WeightGroup
        from gpu_runtime.weight_sync.distributed_push import Broadcaster

        def send(spec: Any, manifest: Any, _version: str, _checksum: str) -> None:
            group = WeightGroup(spec, 0, timeout_s=120)
            try:
                group.send(trainer.published_state(), manifest)
            finally:
                group.close()

        return Broadcaster(address="127.0.0.1", backend=self._dist_backend(), held=lambda: (version, checksum),
                           send=send, timeout_s=120)

    def _push_segment(self, seg: Any, version: int) -> dict[int, str]:
        """What ``update_weights(..., "shared_memory")`` does after publishing, for a segment the
        trainer wrote itself (no folder read): every engine loads it, then reports its checksum."""
        from gpu_runtime.engine.client import EngineClient

        out = {}
        for s in self.fleet.snapshot():
            if s.state != "healthy":
                continue
            with EngineClient(s.url, timeout_s=600) as c:
                c.update_weights_from_shared_memory(str(seg.path), version, seg.checksum)
                out[s.slot] = c.weights_checksum()[0]
        return out

    @staticmethod
    def _gate(got: dict[int, str], checksum: str, how: str, step: int) -> None:
        bad = {k: v[:12] for k, v in got.items() if v != checksum}
        if bad or not got:
            raise AssertionError(f"step {step} {how}: engines {bad or 'none'} do not serve {checksum[:12]}")

    def heal_engine(self) -> dict[str, Any]:
        slot = self.fleet.snapshot()[0]
        t0 = time.perf_counter()
        os.kill(slot.pid, signal.SIGKILL)
        _until(lambda: self.fleet.snapshot()[0].state == "empty", 120, "the fleet to see the engine dead")
        detected = time.perf_counter() - t0
        restarted = self.fleet.restart_empty_slots()
        healed = time.perf_counter() - t0
        s = self.fleet.snapshot()[0]
        if restarted != [0] or s.state != "healthy":
            raise AssertionError(f"slot 0 not healed: restarted={restarted} state={s.state}")
        return {"detect_s": round(detected, 2), "heal_s": round(healed, 2), "new_pid": s.pid,
                "serves_version": s.weight_version}

    def megatron(self) -> dict[str, Any]:
        """``trainer.backend: megatron`` on the GPU: the GPTModel's logits vs the HF model's, then
        ``steps`` GRPO steps of ``MegatronTrainer`` (step 1's loss and grad norm vs the HF
        trainer's on the same batch), a publish (Megatron -> HF folder), and the same steps
        again in a fresh trainer from the same seed: the same weights bitwise."""
        if not have("megatron.core"):
            raise Skip("megatron-core is not installed (pip install --no-deps megatron-core from a carried wheel)")
        if self.args.cpu:
            raise Skip("megatron-core runs no forward on CPU")
        import torch

        from gpu_runtime.models.causal_lm import load_causal_lm
        from gpu_runtime.store.artifacts import Sample
        from gpu_runtime.trainer.megatron import model as mm
        from gpu_runtime.trainer.megatron.trainer import MegatronTrainer
        from gpu_runtime.trainer.policy.trainer import PolicyTrainer
        from spec.train import TrainSpec

        mm.init_single_process()
        gpt, cfg = mm.from_folder(self.base)
        gpt = gpt.to(self.device).float()
        hf = load_causal_lm(self.base).to(self.device)
        ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11]], device=self.device)
        pos = torch.arange(ids.shape[1], device=self.device)[None]
        with torch.no_grad():
            a = gpt(input_ids=ids, position_ids=pos, attention_mask=None).float()
            b = hf(input_ids=ids).logits.float()
        diff = float((a - b).abs().max())
        del gpt, hf, a, b
        torch.cuda.empty_cache()

        hp = TrainSpec(lr=1e-5, micro_batch_size=self.args.micro_batch)
        n = self.args.max_new_tokens

        def batch(step: int) -> tuple[list[Sample], list[float]]:
            samples = [Sample(sample_id=f"s{step}-p0-g{g}", prompt_index=0, group_index=g, prompt_ids=[1, 5, 6, 7 + step],
                              response_ids=list(range(8, 8 + n - g % 3)), logprobs=[-1.0] * (n - g % 3),
                              weight_version=step - 1, finish_reason="length") for g in range(self.args.group)]
            return samples, [float((g + step) % 2) for g in range(self.args.group)]

        ref = PolicyTrainer.create(self.base, hp, self.args.seed)
        want = ref.train_step(*batch(1), self.args.group, hp)
        del ref
        torch.cuda.empty_cache()
        trainer = MegatronTrainer.create(self.base, hp, self.args.seed)
        step_s, metrics = [], []
        for step in range(1, self.args.steps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            metrics.append(trainer.train_step(*batch(step), self.args.group, hp))
            torch.cuda.synchronize()
            step_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        checksum = trainer.export_model_folder(self.work / "megatron" / f"v{self.args.steps:06d}")
        publish_s = time.perf_counter() - t0
        del trainer
        torch.cuda.empty_cache()
        again = MegatronTrainer.create(self.base, hp, self.args.seed)
        for step in range(1, self.args.steps + 1):
            again.train_step(*batch(step), self.args.group, hp)
        same = again.checksum() == checksum
        del again
        torch.cuda.empty_cache()
        got = metrics[0]
        rel = {k: abs(got[k] - want[k]) / max(abs(want[k]), 1e-12) for k in ("loss", "grad_norm")}
        if not same:
            raise AssertionError("megatron: the same seed twice gave different weights")
        return {"logits_max_abs_diff_vs_hf": diff, "matches_hf": diff < 1e-3,
                "train_step_s": [round(x, 3) for x in step_s], "publish_s": round(publish_s, 3),
                "step1_loss": got["loss"], "step1_loss_hf": want["loss"], "step1_grad_norm": got["grad_norm"],
                "step1_grad_norm_hf": want["grad_norm"], "step1_rel_diff_vs_hf": {k: _sig(v) for k, v in rel.items()},
                "same_seed_bitwise": same, "final_checksum": checksum[:16]}

    def precision(self) -> dict[str, Any]:
        """``train.precision`` fp32 vs bf16 on the device: train step seconds side by side (fixed
        samples, steps after the first), and two fresh bf16 trainers end bitwise equal."""
        import torch

        from gpu_runtime.store.artifacts import Sample
        from gpu_runtime.trainer.policy.trainer import PolicyTrainer
        from spec.train import TrainSpec

        n = self.args.max_new_tokens
        samples = [Sample(sample_id=f"s1-p0-g{g}", prompt_index=0, group_index=g, prompt_ids=[1, 5, 6, 7],
                          response_ids=[8 + (g + i) % 20 for i in range(n)], logprobs=[-1.0] * n, weight_version=0,
                          finish_reason="length") for g in range(self.args.group)]
        rewards = [float(g % 2) for g in range(self.args.group)]

        def steps(precision: str) -> tuple[list[float], str]:
            hp = TrainSpec(lr=1e-5, micro_batch_size=self.args.micro_batch, precision=precision)
            trainer = PolicyTrainer.create(self.base, hp, self.args.seed)
            secs = []
            for _ in range(3):
                if torch.cuda.is_available() and not self.args.cpu:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                trainer.train_step(samples, rewards, self.args.group, hp)
                if torch.cuda.is_available() and not self.args.cpu:
                    torch.cuda.synchronize()
                secs.append(time.perf_counter() - t0)
            checksum = trainer.checksum()
            del trainer
            return secs[1:], checksum

        fp32, c32 = steps("fp32")
        bf16, c16 = steps("bf16")
        _, again = steps("bf16")
        if again != c16:
            raise AssertionError(f"bf16, same seed, different weights: {c16[:12]} vs {again[:12]}")
        a, b = sum(fp32) / len(fp32), sum(bf16) / len(bf16)
        return {"fp32_step_s": round(a, 4), "bf16_step_s": round(b, 4), "bf16_over_fp32": round(b / a, 3),
                "bf16_same_seed_bitwise": True, "bf16_differs_from_fp32": c16 != c32}

    # ---------------------------------------------------------------- run
    def run(self) -> dict[str, Any]:
        from gpu_runtime.data.datasets import generate_arithmetic

        r = self.results
        r.data["mode"] = {"cpu": self.args.cpu, "tiny": self.args.tiny, "steps": self.args.steps}
        missing = [m for m in NEEDED if not have(m)]
        r.section("environment", lambda: {**environment(self.device), "missing": missing})
        if missing:
            r.data["verdict"] = f"cannot run: missing {missing} (carry their wheels: bench/gpu_check.sh --wheels DIR)"
            r.write()
            return r.data
        if not self.args.cpu:
            from gpu_runtime.trainer.common.device import use_device

            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            import torch

            torch.use_deterministic_algorithms(True)
            use_device(self.device)  # as the trainer process of a --device cuda node does
        self.rows = generate_arithmetic(500, self.args.seed, 99, "+-*")
        r.section("model_folder", lambda: make_model(self.base, self.args.tiny, self.args.seed))
        try:
            if r.section("engines", self.start_fleet) is None:
                return self._verdict()
            r.section("generation", self.generation)
            first = r.section("grpo", lambda: self.grpo("run1"))
            second = r.section("grpo_same_seed", lambda: self.grpo("run2"))
            if first and second:
                r.section("same_seed_bitwise", lambda: _same(first, second))
            r.section("heal_engine", self.heal_engine)
        finally:
            if self.fleet is not None:
                self.fleet.stop()
        r.section("precision", self.precision)
        r.section("megatron", self.megatron)
        r.section("sglang", lambda: (_ for _ in ()).throw(Skip(
            "sglang is installed but not run by this check" if have("sglang") else "sglang is not installed")))
        return self._verdict()

    def _verdict(self) -> dict[str, Any]:
        secs = self.results.data["sections"]
        failed = [k for k, v in secs.items() if v["status"] == "failed"]
        self.results.data["verdict"] = "ok" if not failed else f"failed: {failed}"
        self.results.write()
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)
        return self.results.data


def _same(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    if a["final_checksum"] != b["final_checksum"]:
        raise AssertionError(f"same seed, different weights: {a['final_checksum'][:12]} vs {b['final_checksum'][:12]}")
    return {"bitwise": True, "checksum": a["final_checksum"][:16]}


def _sig(x: float) -> float:
    """Three significant digits (a tiny model's GB/s is far below 0.01)."""
    return float(f"{x:.3g}")


def _until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="run on the CPU (the rehearsal the tests run)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model and small batches")
    p.add_argument("--out", default="gpu_check_results.json")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--keep", action="store_true", help="keep the work dir (model folder, logs)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--prompts", type=int, default=None, help="prompts per GRPO step")
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    small = a.tiny
    a.steps = a.steps or (2 if small else 3)
    a.prompts = a.prompts or (2 if small else 8)
    a.max_new_tokens = a.max_new_tokens or (8 if small else 64)
    a.micro_batch = a.micro_batch or (4 if small else 8)
    return a


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    data = Check(args).run()
    print(f"[gpu_check] verdict: {data['verdict']} -> {args.out}", flush=True)
    return 0 if data["verdict"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
