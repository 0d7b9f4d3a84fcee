"""LoRA through whole runs on one shared stack (real Temporal server, workers, trainer,
engine and router processes): a tiny 3-step run from a pretrained folder trains only its
adapters, publishes merged weights the engines load (checksum gate), exports a peft
adapter folder, and checkpoints adapters only; a run whose trainer is SIGKILLed mid-step
ends with adapters and merged weights bitwise equal to the fault-free run."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.e2e.faults import (
    assert_bitwise_equal, final_weights, kill_trainer, module_stack_fixtures, run_progress, run_to_end, run_with_fault,
)
from tests.e2e.pretrained import pretrained_folder
from tests.stack import Stack, tiny_config
from workers.common import connect
from workflows.stubs import TRAIN_STEP

pytestmark = pytest.mark.e2e
STEPS = 3
ENV = {"MILESTONE_FAULT_TRAIN_DELAY_S": "2"}  # a kill lands inside train_step
LORA = {"r": 8, "alpha": 16, "export": "adapter"}

stack, store = module_stack_fixtures("lora", ENV)


@pytest.fixture(scope="module")
def cfg(stack: Stack, store: Path) -> dict:
    """LoRA on a base that already adds (a random-init model gives LoRA nothing to adapt in
    3 steps): no warm-up, checkpoints only at the end (a rebuilt trainer restores step 0)."""
    cfg = tiny_config(store, steps=STEPS, sft={"steps": 0}, train={"lr": 1e-3},
                      checkpoint={"every": STEPS, "keep_last": 2}, eval={"enabled": False}, engines={"num_engines": 1})
    base = pretrained_folder(stack.workdir / "pretrained", cfg)
    return {**cfg, "model": {"path": str(base), "lora": LORA}}


@pytest.fixture(scope="module")
def baseline(stack: Stack, cfg: dict) -> str:
    async def main() -> None:
        summary = await run_to_end(await connect(stack.server.address), "lora", cfg)
        assert summary.steps == STEPS and summary.policy_version == STEPS

    asyncio.run(main())
    return "lora"


def manifest_sizes(store: Path, run_id: str, step: int) -> dict[str, int]:
    manifest = json.loads((store / "runs" / run_id / "checkpoints" / f"step-{step:06d}" / "manifest.json").read_text())
    return {name: entry["size"] for name, entry in manifest["files"].items()}


def test_lora_run_trains_adapters_and_publishes_merged_weights(stack: Stack, store: Path, cfg: dict,
                                                               baseline: str) -> None:
    history = run_progress(stack, baseline).steps
    assert [s.step for s in history] == list(range(1, STEPS + 1))
    for s in history:
        assert all(math.isfinite(v) for v in (s.loss, s.grad_norm, s.reward_mean)) and s.grad_norm > 0, s

    base = load_file(str(Path(cfg["model"]["path"]) / "model.safetensors"))
    v0, last = final_weights(store, baseline, 0), final_weights(store, baseline, STEPS)
    assert_bitwise_equal(v0, base)  # fresh adapters (B = 0) publish the base itself
    moved = [k for k in base if not torch.equal(base[k], last[k])]
    assert moved and all(k.endswith("proj.weight") for k in moved), moved  # only adapted linear layers

    # the adapter export loads in peft over its base and computes what the merged folder does
    from peft import AutoPeftModelForCausalLM

    version = store / "runs" / baseline / "weights" / f"v{STEPS:06d}"
    adapter = json.loads((version / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == cfg["model"]["path"] and adapter["r"] == LORA["r"]
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(version), attn_implementation="eager")
    peft_model = AutoPeftModelForCausalLM.from_pretrained(str(version / "adapter"), attn_implementation="eager")
    ids = torch.tensor([[3, 20, 21, 15, 22, 30]])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, merged(ids).logits, rtol=0, atol=1e-5)

    # the checkpoint holds the adapters and their optimizer state only
    sizes = manifest_sizes(store, baseline, STEPS)
    full = (version / "model.safetensors").stat().st_size
    lora_bytes = sizes["policy.safetensors"] + sizes["optimizer.safetensors"]
    print(f"LoRA checkpoint step {STEPS}: policy {sizes['policy.safetensors']} B + optimizer "
          f"{sizes['optimizer.safetensors']} B; the merged weights: {full} B")
    # full fine-tuning checkpoints the weights and two AdamW moments of each: about 3 x full
    assert sizes["policy.safetensors"] < full / 4 and lora_bytes < full


def test_trainer_killed_mid_step_ends_bitwise_equal(stack: Stack, store: Path, cfg: dict, baseline: str) -> None:
    run_id = "lora-trainer-crash"
    _, prog, old = run_with_fault(stack, run_id, cfg, (2, TRAIN_STEP), kill_trainer)
    assert prog.steps[1].restored_from_step == 0 and prog.steps[1].replayed_steps == [1]
    assert stack.node_pids("node0")["trainer"] != old
    assert_bitwise_equal(final_weights(store, run_id, STEPS), final_weights(store, baseline, STEPS))
    for name in ("adapter/adapter_model.safetensors",):
        a, b = (store / "runs" / r / "weights" / f"v{STEPS:06d}" / name for r in (run_id, baseline))
        assert_bitwise_equal(load_file(str(a)), load_file(str(b)))
    ckpt = [store / "runs" / r / "checkpoints" / f"step-{STEPS:06d}" / "manifest.json" for r in (run_id, baseline)]
    shas = [{k: v["sha256"] for k, v in json.loads(p.read_text())["files"].items() if k.endswith(".safetensors")}
            for p in ckpt]
    assert shas[0]["policy.safetensors"] == shas[1]["policy.safetensors"]
    assert shas[0]["optimizer.safetensors"] == shas[1]["optimizer.safetensors"]
