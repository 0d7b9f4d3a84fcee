"""Shared by the megatron backend's tests: the GPTModel call on an HF model, the CPU shim
for megatron-core's CUDA-only bits (megatron-core is a dev dependency: the CPU tests always
run), and the few-steps script the CUDA test and its CPU rehearsal both run
(``run_steps`` / ``check_steps``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch



class HFAsGPT(torch.nn.Module):
    """An HF causal LM called the way a Megatron GPTModel is (logits, causal, no key mask):
    the megatron trainer's one CUDA-only part (the GPTModel forward), replaced on CPU by the
    reference's own model so the rest of it can be checked against ``PolicyTrainer``."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: None) -> torch.Tensor:
        assert attention_mask is None
        return self.hf(input_ids=input_ids, position_ids=position_ids).logits


def shim_cpu_forward() -> None:
    """Let megatron-core 0.16's GPTModel (local spec, dropout 0) run its forward on CPU, in a
    test process only: its causal mask and rotary frequencies are put on
    ``torch.cuda.current_device()`` / ``device="cuda"`` unconditionally, and its dropout
    forks the CUDA RNG tracker. The three are replaced by their CPU equivalents (the same
    mask, the same frequencies, no RNG: dropout is 0); everything else is megatron-core's
    own code. Fakes only what cannot run here (CUDA)."""
    import contextlib

    import megatron.core.fusions.fused_softmax as fused_softmax
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()
    mrandom.initialize_rng_tracker()
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]


STEPS_SCRIPT = r"""
import json, sys, torch, warnings
warnings.filterwarnings("ignore")
from pathlib import Path
torch.use_deterministic_algorithms(True)
cuda = sys.argv[3] == "cuda"
if cuda:
    from gpu_runtime.trainer.common.device import use_device

    use_device("cuda:0")  # as the trainer process of a --device cuda node
else:
    from tests.megatron_fixtures import shim_cpu_forward

    shim_cpu_forward()
from transformers import AutoModelForCausalLM
from gpu_runtime.models.causal_lm import export_state_dict
from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.megatron.trainer import MegatronTrainer
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from spec.train import TrainSpec

src, work = Path(sys.argv[1]), Path(sys.argv[2])
hp = TrainSpec(lr=1e-4, warmup_steps=2, micro_batch_size=4)

def batch(step):
    samples = [Sample(sample_id=f"s{step}-p{p}-g{g}", prompt_index=p, group_index=g, prompt_ids=[1, 5 + p, 6 + step],
                      response_ids=[7, 8, 9 + g, 10][: 1 + (g + p + step) % 4], logprobs=[-1.0] * (1 + (g + p + step) % 4),
                      weight_version=step - 1, finish_reason="length") for p in range(2) for g in range(4)]
    return samples, [float((g + p * step) % 3) / 2 for p in range(2) for g in range(4)]

out = {}
want = PolicyTrainer.create(src, hp, 0).train_step(*batch(1), 4, hp)
a = MegatronTrainer.create(src, hp, 0, require_cuda=cuda)
steps = [a.train_step(*batch(1), 4, hp)]
a.save_state(work / "ck")
steps += [a.train_step(*batch(k), 4, hp) for k in (2, 3)]
out["want"] = {k: want[k] for k in ("loss", "grad_norm", "entropy", "clip_fraction")}
out["got"] = {k: steps[0][k] for k in ("loss", "grad_norm", "entropy", "clip_fraction")}
out["same_metric_names"] = set(want) == set(steps[0])
out["lrs"] = [m["lr"] for m in steps]
out["versions"] = [m["policy_version"] for m in steps]
out["a"] = a.checksum()
b = MegatronTrainer.create(src, hp, 0, require_cuda=cuda)
for k in (1, 2, 3):
    b.train_step(*batch(k), 4, hp)
out["b"] = b.checksum()
del b
c = MegatronTrainer.from_state(work / "ck", require_cuda=cuda)
for k in (2, 3):
    c.train_step(*batch(k), 4, hp)
out["c"] = c.checksum()
del c
ck = a.export_model_folder(work / "v3")
hf = export_state_dict(AutoModelForCausalLM.from_pretrained(str(work / "v3"), dtype=torch.float32))
mine = a.published_state()
out["export"] = [ck == out["a"], set(hf) == set(mine) and all(torch.equal(hf[k].cpu(), mine[k].cpu()) for k in mine)]
print("RESULT " + json.dumps(out))
"""


SERVICE_SCRIPT = r"""
import json, sys, torch, warnings
warnings.filterwarnings("ignore")
from pathlib import Path
torch.use_deterministic_algorithms(True)
work, device = Path(sys.argv[1]), sys.argv[2]
if device == "cuda":
    from gpu_runtime.trainer.common.device import use_device

    use_device("cuda:0")  # as the trainer process of a --device cuda node
else:
    from tests.megatron_fixtures import shim_cpu_forward
    from gpu_runtime.trainer.megatron import trainer as mt

    shim_cpu_forward()
    mt.runtime_problem = lambda need_cuda=True: None  # the CPU rehearsal: the shim stands in for CUDA
from bench._inproc import dataset_rows, run_setup, step_batch, store_rollout
from gpu_runtime.data.rewards import score_samples
from gpu_runtime.models.causal_lm import load_causal_lm
from gpu_runtime.models.model_folder import model_checksum
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.object_store import LocalStore
from gpu_runtime.trainer.service import TrainerService
from tests.stack import tiny_config
from spec.run import RunConfig

RUN = "mg"
cfg = RunConfig.model_validate(tiny_config(
    work / "store", steps=2, sft={"steps": 5}, train={"lr": 1e-3, "micro_batch_size": 4},
    checkpoint={"every": 100, "keep_last": 5}, trainer={"backend": "megatron"}))
setup = run_setup(cfg, RUN)
store = LocalStore(work / "store")
rows = dataset_rows(cfg, work / "train.jsonl")
store.put_file(setup.dataset_key, work / "train.jsonl")
by_index = dict(enumerate(rows))
first = TrainerService(work / "first")
v0 = first.ensure_version(setup, 0)  # SFT on the HF trainer -> post-SFT folder -> the GPTModel; checkpoint v0
out = {"trainer": type(first.trainer).__name__, "v0_sft_steps": v0.sft_metrics.get("sft_steps")}
folder, checksums = Path(v0.model_path), [v0.checksum]
for step in (1, 2):
    keys, samples = store_rollout(store, cfg, RUN, step, folder, rows)
    rkey = art.rewards_key(RUN, step)
    scored = score_samples(samples, by_index, cfg.reward)
    # plus a made-up term so every group has reward variance (a tiny model after 5 SFT steps is
    # rarely right: equal rewards would be a zero gradient, a step that proves nothing)
    scored = [r.model_copy(update={"reward": r.reward + (i % 3) / 2}) for i, r in enumerate(scored)]
    art.put_model(store, rkey, art.StepRewards(run_id=RUN, step=step, rewards=scored))
    res = first.train_step(setup, step_batch(cfg, RUN, step, keys, rkey))
    checksums.append(res.checksum)
    folder = first._weights_dir(res.policy_version)
    if step == 1:
        first.save_checkpoint(1, data_cursor=4, sync=True)
out["metrics"] = sorted(res.metrics)
out["versions"] = res.policy_version
out["distinct"] = len(set(checksums))
out["published"] = model_checksum(load_causal_lm(folder)) == checksums[-1]  # what an engine loads
second = TrainerService(work / "second")  # a new trainer process: restore step 1, replay step 2
info = second.ensure_version(setup, 2)
out["rebuild"] = [info.rebuild.restored_from_step, info.rebuild.replayed_steps] if info.rebuild else None
out["replayed_bitwise"] = info.checksum == checksums[-1]
out["second_trainer"] = type(second.trainer).__name__
print("RESULT " + json.dumps(out))
"""


def run_script(script: str, args: list[str], repo: Path) -> dict[str, Any]:
    """A script in its own process (a world of one; the default device it sets stays there);
    its ``RESULT {json}`` line."""
    r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600, cwd=repo,
                       env={**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.split("RESULT ", 1)[1])


def run_steps(folder: Path, work: Path, device: str, repo: Path) -> dict[str, Any]:
    """``STEPS_SCRIPT`` on ``device`` (cuda, or cpu with the shim)."""
    work.mkdir(parents=True, exist_ok=True)
    return run_script(STEPS_SCRIPT, [str(folder), str(work), device], repo)


def run_service(work: Path, device: str, repo: Path) -> dict[str, Any]:
    """``SERVICE_SCRIPT`` on ``device``: a megatron run through ``TrainerService`` (what the node's
    trainer process runs), then a second service restoring and replaying it."""
    work.mkdir(parents=True, exist_ok=True)
    return run_script(SERVICE_SCRIPT, [str(work), device], repo)


def check_service(out: dict[str, Any]) -> None:
    assert out["trainer"] == out["second_trainer"] == "MegatronTrainer"
    assert out["v0_sft_steps"] == 5.0 and out["versions"] == 2 and out["distinct"] == 3
    assert {"loss", "grad_norm", "lr", "policy_version", "rollout_logprob_abs_diff"} <= set(out["metrics"])
    assert out["published"], "the published folder is not the version's checksum"
    assert out["rebuild"] == [1, [2]] and out["replayed_bitwise"]


def check_steps(out: dict[str, Any], rel: float) -> None:
    """Step 1 against the HF trainer within ``rel``; same-seed and restore-and-replay bitwise;
    the published folder the trainer's weights bitwise."""
    import pytest

    want, got = out["want"], out["got"]
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=rel)
    assert got["loss"] == pytest.approx(want["loss"], rel=rel, abs=1e-6)
    assert got["entropy"] == pytest.approx(want["entropy"], rel=rel)
    assert got["clip_fraction"] == want["clip_fraction"] == 0.0  # step 1: the ratio is 1
    assert out["same_metric_names"]
    assert out["lrs"] == [0.5e-4, 1e-4, 1e-4] and out["versions"] == [1.0, 2.0, 3.0]
    assert out["a"] == out["b"], "the same seed twice: different weights"
    assert out["a"] == out["c"], "restore at step 1 + replay of steps 2-3: different weights"
    assert out["export"] == [True, True]
