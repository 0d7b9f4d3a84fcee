"""Shared by the megatron backend's tests: the GPTModel call on an HF model, the CPU shim
for megatron-core's CUDA-only bits (megatron-core is a dev dependency: the CPU tests always
run), and the few-steps program the CUDA test and its CPU rehearsal both run
(``tests/scripts/megatron_steps.py``: ``run_steps`` / ``check_steps``)."""

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

    torch.cuda.current_device = lambda: "cpu"
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()
    mrandom.initialize_rng_tracker()
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def run_script(module: str, args: list[str], repo: Path) -> dict[str, Any]:
    """``tests.scripts.<module>`` in its own process (a world of one; the default device it sets
    stays there); its ``RESULT {json}`` line."""
    r = subprocess.run([sys.executable, "-m", f"tests.scripts.{module}", *args], capture_output=True, text=True,
                       timeout=600, cwd=repo,
                       env={**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.split("RESULT ", 1)[1])


def run_steps(folder: Path, work: Path, device: str, repo: Path) -> dict[str, Any]:
    """``tests.scripts.megatron_steps`` on ``device`` (cuda, or cpu with the shim)."""
    work.mkdir(parents=True, exist_ok=True)
    return run_script("megatron_steps", [str(folder), str(work), device], repo)


def run_service(work: Path, device: str, repo: Path) -> dict[str, Any]:
    """``tests.scripts.megatron_service`` on ``device``: a megatron run through ``TrainerService``
    (what the node's trainer process runs), then a second service restoring and replaying it."""
    work.mkdir(parents=True, exist_ok=True)
    return run_script("megatron_service", [str(work), device], repo)


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
