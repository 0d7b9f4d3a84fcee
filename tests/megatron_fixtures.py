"""Shared by the megatron backend's tests: the GPTModel call on an HF model, and whether
megatron-core is importable (the ``[gpu]`` extra; CI installs none)."""

from __future__ import annotations

import importlib.util

import torch

HAVE_MCORE = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
NO_MCORE = "megatron-core is not installed (the [gpu] extra; CI installs none)"


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
