"""The random-init Qwen2-style model the in-process trainer benches train: its
``--hidden`` / ``--layers`` flags and its base model folder (BPE tokenizer trained on
arithmetic rows; nothing downloaded)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from gpu_runtime.data.datasets import generate_arithmetic
from gpu_runtime.trainer.base_model import base_model_folder
from spec.model import ModelInitSpec, ModelSpec


def add_model_args(p: argparse.ArgumentParser, *, hidden: int = 256, layers: int = 4) -> None:
    p.add_argument("--hidden", type=int, default=hidden, help="hidden size (the MLP is 2x, 4 heads, 2 KV heads)")
    p.add_argument("--layers", type=int, default=layers, help="decoder layers")


def tiny_base_folder(args: argparse.Namespace, prefix: str, seed: int = 7) -> Path:
    """The base model folder of ``add_model_args``' shape, in a fresh temp dir."""
    init = ModelInitSpec(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    source = ModelSpec(init=init)
    return base_model_folder(source, generate_arithmetic(32, seed=0, max_operand=20), seed,
                             Path(tempfile.mkdtemp(prefix=prefix)))
