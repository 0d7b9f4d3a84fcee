"""The policy's per-token log-probabilities of a right-padded batch.

The trainer trains the policy that sampled: the engines sample from ``logits / T``
(``rollout.temperature``), so every logprob, ratio, KL and entropy of an RL step is taken
from ``logits / T`` too (``temperature``). At ``T == 1`` nothing is divided, so the numbers
are bitwise those of a plain log-softmax."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from gpu_runtime.models.causal_lm import lm_logits, positions_from_mask
from gpu_runtime.models.precision import forward_precision


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature``: the logits of the distribution an engine samples at that
    temperature (top-p / top-k aside: RL refuses them). ``temperature`` 1 returns ``logits``
    itself (no division, so bitwise unchanged); it must be > 0 (0 is greedy: no distribution)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for logprobs (0 is greedy), got {temperature}")
    return logits if temperature == 1.0 else logits / temperature


def token_logprobs(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probability of the next token for a right-padded batch.
    Returns ``[B, T-1]``: entry ``[b, j]`` is log p(input_ids[b, j+1] | input_ids[b, :j+1]).
    Entries whose target is padding are meaningless (mask them with ``attention_mask[:, 1:]``)."""
    lp, _ = logprobs_and_logits(model, input_ids, attention_mask, temperature=temperature)
    return lp


def logprobs_and_logits(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, precision: str = "fp32",
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like ``token_logprobs`` and also returns the logits ``[B, T-1, V]`` that produced them
    (divided by ``temperature``: the entropy of the sampling policy is taken from them).
    ``precision`` (``train.precision``) is what the model's forward runs in; the logits come
    out float32 either way, and the log-softmax and everything after it are float32."""
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ")
    key_mask = attention_mask.to(torch.bool)
    with forward_precision(precision, input_ids.device):
        logits = lm_logits(model, input_ids, key_mask, positions_from_mask(key_mask))
    return target_logprobs(logits[:, :-1], input_ids[:, 1:], temperature)


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor,
                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets) ``[B, T-1]``, the tempered logits ``[B, T-1, V]``) from next-token
    logits at ``temperature``: the one recipe of every trainer backend."""
    logits = tempered(logits, temperature)
    lp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return lp, logits
