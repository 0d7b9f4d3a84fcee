"""A "pretrained" model folder for e2e runs that start from ``model.path`` (LoRA on top of
it, a distillation teacher): the base a tiny run would build from its ``model.init``
(byte-identical tokenizer), trained in this process by the same supervised warm-up."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from gpu_runtime.data.datasets import generate_arithmetic
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from gpu_runtime.trainer.base_model import base_model_folder
from spec.model import ModelSpec
from spec.run import RunConfig


def pretrained_folder(out: Path, cfg: dict, sft_steps: int = 100, lr: float = 3e-3) -> Path:
    """``cfg``'s (a ``tiny_config``) base model after ``sft_steps`` of full fine-tuning on its
    arithmetic rows, as a Hugging Face folder at ``out``."""
    run = RunConfig.model_validate(cfg)
    d, init = run.data, run.model.init
    assert d.kind == "arithmetic" and init is not None
    rows = generate_arithmetic(d.num_train, run.seed, d.max_operand, d.ops, min_operand=d.min_operand)
    source = ModelSpec(init=init)
    base = base_model_folder(source, rows, run.seed, Path(tempfile.mkdtemp(prefix="pretrained-")))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = PolicyTrainer.create(base, run.train, run.seed)
        trainer.sft_warmup(rows, sft_steps, run.sft.batch_size, lr, run.seed, betas=run.sft.betas)
        trainer.export_model_folder(out)
    finally:
        torch.set_num_threads(threads)
    return out
