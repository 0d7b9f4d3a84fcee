"""A real megatron-core GPTModel on CPU, in a process of its own (a world of one): its export,
checkpoint, restore and replay bitwise, and the backends refusing each other's checkpoints.
``tests/unit/test_megatron_trainer.py::test_a_real_gpt_model_exports_and_checkpoints_bitwise``
runs it (``python -m tests.scripts.megatron_real_model <model folder> <work dir>``); prints
``RESULT {json}``."""

from __future__ import annotations

import json
import random
import sys
import warnings
from pathlib import Path
from typing import Any

import torch


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from gpu_runtime.models.causal_lm import export_state_dict
    from gpu_runtime.models.model_folder import weights_checksum
    from gpu_runtime.trainer.megatron.trainer import MegatronTrainer
    from gpu_runtime.trainer.policy.trainer import PolicyTrainer
    from spec.train import TrainSpec

    src, work = Path(argv[0]), Path(argv[1])
    out: dict[str, object] = {}
    hp = TrainSpec(lr=1e-3, warmup_steps=2)
    try:
        MegatronTrainer.create(src, hp, 0)
    except ValueError as e:
        out["cpu_refused"] = str(e)
    t = MegatronTrainer.create(src, hp, 0, require_cuda=False)
    ref = load_file(str(src / "model.safetensors"))

    def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in b)

    def loaded(folder: Path) -> dict[str, torch.Tensor]:
        return export_state_dict(AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32))

    ck = t.export_model_folder(work / "v0")
    out["files"] = sorted(p.name for p in (work / "v0").iterdir())
    out["meta"] = json.loads((work / "v0" / "milestone.json").read_text())
    out["export_bitwise"] = same(loaded(work / "v0"), ref)
    out["checksums"] = [ck == weights_checksum(ref), t.checksum() == ck]

    def step(tr: Any, k: int) -> None:
        # megatron-core has no CPU forward: fixed grads, then the trainer's own clipped AdamW step
        g = torch.Generator().manual_seed(100 + k)
        tr.start_optimizer_step(hp)
        for p in tr.model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        tr.take_optimizer_step(hp, "test")
        tr.policy_version += 1

    step(t, 1)
    step(t, 2)
    out["moved"] = t.checksum() != ck
    rng, py = torch.get_rng_state(), random.getstate()
    t.save_state(work / "ck")
    torch.manual_seed(1)
    random.seed(1)
    r = MegatronTrainer.from_state(work / "ck", require_cuda=False)
    out["restored"] = [r.checksum() == t.checksum(), r.policy_version, r.opt_steps, r.seed]
    a, b = t.optimizer.state_dict(), r.optimizer.state_dict()
    out["optimizer_bitwise"] = a["state"].keys() == b["state"].keys() and all(
        torch.equal(a["state"][i][n], b["state"][i][n]) for i in a["state"] for n in a["state"][i])
    out["rng_restored"] = torch.equal(torch.get_rng_state(), rng) and random.getstate() == py
    step(t, 3)
    step(r, 3)
    out["replay_bitwise"] = r.checksum() == t.checksum()
    t.export_model_folder(work / "v3")
    out["trained_export_bitwise"] = same(loaded(work / "v3"), t.published_state())
    try:
        PolicyTrainer.from_state(work / "ck")
    except ValueError as e:
        out["hf_refuses"] = str(e)
    PolicyTrainer.create(src, hp, 0).save_state(work / "hfck")
    try:
        r.load_state(work / "hfck")
    except ValueError as e:
        out["megatron_refuses"] = str(e)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1:])
