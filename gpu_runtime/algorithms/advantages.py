"""Advantage estimators as plain torch functions (``train.estimator``).

Shapes: ``rewards`` is flat ``[N]`` with each group's ``group_size`` samples
contiguous. Token-level inputs and outputs are **response-aligned** ``[N, L]``:
column ``t`` is the ``t``-th response token of a sample, ``mask`` marks the real
ones (a sample of ``n`` response tokens has ``mask[i, :n]`` true). Every
estimator returns ``[N, L]`` advantages (sequence-level ones broadcast over the
sample's tokens), zero where ``mask`` is false. Nothing here needs gradients.

KL in the reward (``train.kl_in_reward``): ``token_kl [N, L]`` is the per-token
KL estimate of the policy that generated the samples to the reference, and
``kl_coef`` its weight. The token rewards are ``-kl_coef * kl_t`` with the
outcome reward added on the last response token, so the return from token ``t``
is ``G_t = r - kl_coef * sum_{s >= t} kl_s`` (no discount) and the sequence
reward is ``G_0``.
"""

from __future__ import annotations

from typing import Literal

import torch

Estimator = Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "cispo", "ppo"]
ESTIMATORS: tuple[Estimator, ...] = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "cispo", "ppo")
WHITEN_EPS = 1e-8


def _groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """``rewards`` as float32 ``[n_groups, group_size]``, after checking the shape."""
    if group_size <= 0:
        raise ValueError(f"group_size must be > 0, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be 1-D with a multiple of group_size={group_size} entries, got {tuple(rewards.shape)}"
        )
    return rewards.to(torch.float32).view(-1, group_size)


def group_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, scale_by_std: bool = True
) -> torch.Tensor:
    """GRPO advantages ``[N]``: A_i = (r_i - mean_g) / (std_g + eps) where std is
    the population std (``unbiased=False``); without ``scale_by_std`` only the
    mean is subtracted (Dr. GRPO). A group whose rewards are all equal gets 0."""
    r = _groups(rewards, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale_by_std:
        centred = centred / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (leave-one-out) advantages ``[N]``: A_i = r_i - mean of the group's
    other samples = (G r_i - sum_g) / (G - 1). A group of one sample gets 0."""
    r = _groups(rewards, group_size)
    if group_size == 1:
        return torch.zeros(r.numel())
    others = (r.sum(dim=1, keepdim=True) - r) / (group_size - 1)
    return (r - others).reshape(-1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = WHITEN_EPS) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with the mean and the population variance taken
    over ``mask`` (all of the batch's response tokens); 0 outside ``mask``."""
    m = mask.to(torch.float32)
    n = m.sum().clamp(min=1.0)
    mean = (values * m).sum() / n
    var = (((values - mean) * m) ** 2).sum() / n
    return (values - mean) * torch.rsqrt(var + eps) * m


def token_returns(
    rewards: torch.Tensor, mask: torch.Tensor, token_kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Undiscounted returns ``[N, L]``: G_t = r_i - kl_coef * sum_{s >= t} kl_s over
    the sample's response tokens (just r_i on every token without ``token_kl``)."""
    m = mask.to(torch.float32)
    g = rewards.to(torch.float32)[:, None] * m
    if token_kl is not None and kl_coef:
        kl = token_kl.to(torch.float32) * m
        g = g - kl_coef * kl.flip(-1).cumsum(-1).flip(-1) * m
    return g


def reinforce_pp_advantages(
    rewards: torch.Tensor, mask: torch.Tensor, token_kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """REINFORCE++: the token returns whitened over every response token of the batch."""
    return masked_whiten(token_returns(rewards, mask, token_kl, kl_coef), mask)


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, group_size: int, mask: torch.Tensor,
    token_kl: torch.Tensor | None = None, kl_coef: float = 0.0,
) -> torch.Tensor:
    """REINFORCE++-baseline: the token returns minus the group's mean outcome reward,
    then whitened over every response token of the batch."""
    r = _groups(rewards, group_size)
    baseline = r.mean(dim=1, keepdim=True).expand_as(r).reshape(-1)
    centred = token_returns(rewards, mask, token_kl, kl_coef) - baseline[:, None] * mask.to(torch.float32)
    return masked_whiten(centred, mask)


def compute_advantages(
    estimator: Estimator,
    rewards: torch.Tensor,
    group_size: int,
    mask: torch.Tensor,
    *,
    scale_by_std: bool = True,
    token_kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """The advantages ``[N, L]`` of ``estimator``. ``gspo`` and ``cispo`` use GRPO's
    group advantages (they differ in the policy loss). With ``token_kl`` the KL is
    part of the reward: sequence-level estimators see r_i - kl_coef * sum_t kl_t."""
    if mask.dim() != 2 or mask.shape[0] != rewards.numel():
        raise ValueError(f"mask must be [N, L] with N={rewards.numel()} samples, got {tuple(mask.shape)}")
    m = mask.to(torch.float32)
    if estimator == "ppo":
        raise ValueError("estimator ppo needs the critic's values: use gae.gae_advantages_and_returns")
    if estimator == "reinforce_pp":
        return reinforce_pp_advantages(rewards, mask, token_kl, kl_coef)
    if estimator == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(rewards, group_size, mask, token_kl, kl_coef)
    seq_rewards = rewards.to(torch.float32)
    if token_kl is not None and kl_coef:
        seq_rewards = seq_rewards - kl_coef * (token_kl.to(torch.float32) * m).sum(dim=1)
    if estimator == "rloo":
        adv = rloo_advantages(seq_rewards, group_size)
    elif estimator in ("grpo", "gspo", "cispo"):
        adv = group_advantages(seq_rewards, group_size, scale_by_std=scale_by_std)
    else:
        raise ValueError(f"estimator must be one of {', '.join(ESTIMATORS)}, got {estimator!r}")
    return adv[:, None] * m
