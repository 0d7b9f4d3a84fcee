"""GRPO building blocks as plain torch functions.

Aggregation convention (used everywhere in the trainer): losses are a
**token mean over the whole batch** — the per-token terms of every response
token of every sample are summed and divided by the total number of response
tokens (DAPO-style "token-level" loss), so long responses weigh more than short
ones and micro-batching does not change the result (each micro-batch's mean is
weighted by its share of the batch's tokens). Padding and prompt tokens are
excluded by ``mask``.
"""

from __future__ import annotations

import torch

from transformers import PreTrainedModel

from gpu_runtime.models.causal_lm import lm_logits, positions_from_mask


def group_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, scale_by_std: bool = True
) -> torch.Tensor:
    """GRPO advantages. ``rewards`` is flat ``[n_groups * group_size]`` with each
    group's samples contiguous. A_i = (r_i - mean_g) / (std_g + eps) where std is
    the population std (``unbiased=False``); without ``scale_by_std`` only the
    mean is subtracted (Dr. GRPO). A group whose rewards are all equal gets 0."""
    if group_size <= 0:
        raise ValueError(f"group_size must be > 0, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(rewards.shape)}")
    r = rewards.to(torch.float32).view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.reshape(-1)


def token_logprobs(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-token log-probability of the next token for a right-padded batch.
    Returns ``[B, T-1]``: entry ``[b, j]`` is log p(input_ids[b, j+1] | input_ids[b, :j+1]).
    Entries whose target is padding are meaningless (mask them with ``attention_mask[:, 1:]``)."""
    lp, _ = logprobs_and_logits(model, input_ids, attention_mask)
    return lp


def logprobs_and_logits(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like ``token_logprobs`` and also returns the logits ``[B, T-1, V]`` that produced them."""
    if input_ids.shape != attention_mask.shape:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ")
    key_mask = attention_mask.to(torch.bool)
    logits = lm_logits(model, input_ids, key_mask, positions_from_mask(key_mask))[:, :-1]
    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return lp, logits


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over ``mask`` divided by the mask's count (0 when the mask is empty)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate, token mean over ``mask``.

    ratio = exp(logprobs - old_logprobs); per token
    loss = max(-A * ratio, -A * clamp(ratio, 1 - clip_eps, 1 + clip_eps_high)),
    with ``clip_eps_high`` defaulting to ``clip_eps`` (set it higher for DAPO's
    clip-higher). ``advantages`` is ``[B]`` (one per sequence, broadcast over
    tokens) or ``[B, T]``. Returns (loss, clip_fraction) where clip_fraction is
    the share of masked tokens where the clipped term was the active one."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logprobs - old_logprobs)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    per_token = torch.maximum(pg1, pg2)
    loss = masked_mean(per_token, mask)
    clip_fraction = masked_mean((pg2 > pg1).to(per_token.dtype), mask).detach()
    return loss, clip_fraction


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || ref), token mean over ``mask``:
    with d = ref - logprobs, k3 = exp(d) - d - 1 (>= 0, unbiased)."""
    d = ref_logprobs - logprobs
    return masked_mean(torch.exp(d) - d - 1.0, mask)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy ``[...]`` of the categorical given by ``logits [..., V]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
