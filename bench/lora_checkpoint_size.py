"""Checkpoint size with and without LoRA on the demo model (examples/demo.yaml's shape,
built by ``model.init``): a trainer takes one RL step on fixed samples (so AdamW has its
moments), saves its state, and the trained files' sizes are printed, full fine-tuning vs
``model.lora`` at each rank given (all-linear, alpha 2r).

    .venv/bin/python -m bench.lora_checkpoint_size [--ranks 8 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_runtime.data.datasets import encode_prompt, generate_arithmetic  # noqa: E402
from gpu_runtime.store.artifacts import Sample  # noqa: E402
from gpu_runtime.trainer.policy.trainer import PolicyTrainer  # noqa: E402
from gpu_runtime.trainer.base_model import base_model_folder  # noqa: E402
from milestone_cli.config_file import load_run_config  # noqa: E402
from spec.model import LoraSpec, ModelSpec  # noqa: E402

FILES = ("policy.safetensors", "optimizer.safetensors")


def sizes(trainer: PolicyTrainer, rows: list[dict], out: Path) -> dict[str, int]:
    tok = trainer.tokenizer
    samples = [  # 4 prompts x 4 one-digit answers
        Sample(sample_id=f"s{p}-{g}", prompt_index=p, group_index=g, prompt_ids=encode_prompt(tok, rows[p]),
               response_ids=tok.encode(str(g)) + [tok.eos_token_id], logprobs=[], weight_version=0, finish_reason="stop")
        for p in range(4) for g in range(4)]
    trainer.train_step(samples, [float(g % 2) for _ in range(4) for g in range(4)], 4, trainer.hparams)
    trainer.save_state(out)
    return {f: (out / f).stat().st_size for f in FILES}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = load_run_config(Path(__file__).resolve().parents[1] / "examples" / "demo.yaml")
    d, init = cfg.data, cfg.model.init
    assert init is not None
    rows = generate_arithmetic(d.num_train, cfg.seed, d.max_operand, d.ops, min_operand=d.min_operand)
    work = Path(tempfile.mkdtemp(prefix="lora-size-"))
    base = base_model_folder(ModelSpec(init=init),
                             rows, cfg.seed, work)
    hp = cfg.train
    full = sizes(PolicyTrainer.create(base, hp, cfg.seed), rows, work / "full")
    n = sum(t.numel() for t in PolicyTrainer.create(base, hp, cfg.seed).model.parameters())
    print(f"demo model: {n / 1e6:.2f}M weights")
    print(f"{'':28s} {'policy':>12s} {'optimizer':>12s} {'total':>12s}")
    print(f"{'full fine-tuning':28s} {full[FILES[0]]:>12,d} {full[FILES[1]]:>12,d} {sum(full.values()):>12,d}")
    for r in args.ranks:
        lora = LoraSpec(r=r, alpha=2.0 * r, dropout=0.0, target_modules="all-linear", export="merged")
        got = sizes(PolicyTrainer.create(base, hp, cfg.seed, lora), rows, work / f"lora-{r}")
        ratio = sum(full.values()) / sum(got.values())
        print(f"{f'LoRA r {r}, all-linear':28s} {got[FILES[0]]:>12,d} {got[FILES[1]]:>12,d} "
              f"{sum(got.values()):>12,d}  ({ratio:.1f}x smaller)")


if __name__ == "__main__":
    main()
