"""The policy's per-token log-probabilities of a right-padded batch."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from gpu_runtime.models.causal_lm import lm_logits, positions_from_mask
from gpu_runtime.models.precision import forward_precision


def token_logprobs(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-token log-probability of the next token for a right-padded batch.
    Returns ``[B, T-1]``: entry ``[b, j]`` is log p(input_ids[b, j+1] | input_ids[b, :j+1]).
    Entries whose target is padding are meaningless (mask them with ``attention_mask[:, 1:]``)."""
    lp, _ = logprobs_and_logits(model, input_ids, attention_mask)
    return lp


def logprobs_and_logits(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, precision: str = "fp32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like ``token_logprobs`` and also returns the logits ``[B, T-1, V]`` that produced them.
    ``precision`` (``train.precision``) is what the model's forward runs in; the logits come
    out float32 either way, and the log-softmax and everything after it are float32."""
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ")
    key_mask = attention_mask.to(torch.bool)
    with forward_precision(precision, input_ids.device):
        logits = lm_logits(model, input_ids, key_mask, positions_from_mask(key_mask))
    logits = logits[:, :-1]
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return lp, logits
