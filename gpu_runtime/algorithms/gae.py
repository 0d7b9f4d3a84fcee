"""PPO with a critic: token rewards, GAE advantages and returns, the clipped value loss.

Shapes follow ``advantages.py``: ``[N, L]`` response-aligned (column ``t`` is the
``t``-th response token, ``mask`` marks the real ones). ``values[i, t]`` is the
critic's V(s_t): its estimate of the return from the state *before* response token
``t`` is emitted (the prefix prompt + response[:t]).

GAE (Schulman et al. 2016), the recursion verl and OpenRLHF use, over the tokens of
``mask`` only (a masked position is skipped: it neither bootstraps nor accumulates,
so a hole in the mask joins the tokens on either side):

    delta_t = r_t + gamma * V_{t'} - V_t          (t' the next real token; V = 0 past the end)
    A_t     = delta_t + gamma * lam * A_{t'}
    R_t     = A_t + V_t                            (the critic's regression target)

With gamma = lam = 1 this is R_t = sum_{s >= t} r_s (the reward-to-go) and
A_t = R_t - V_t. The advantages are then whitened over every response token of the
batch (verl's ``compute_gae_advantage_return``); the returns are not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_runtime.algorithms.advantages import masked_whiten
from gpu_runtime.algorithms.losses import masked_mean


def token_level_rewards(
    rewards: torch.Tensor, mask: torch.Tensor, token_kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """``[N, L]`` per-token rewards: each sample's outcome reward on its last response
    token, minus ``kl_coef * kl_t`` on every response token when the KL is in the reward.
    A sample without a response token gets nothing."""
    m = mask.to(torch.float32)
    n, width = m.shape
    if rewards.numel() != n:
        raise ValueError(f"rewards has {rewards.numel()} entries for {n} samples")
    out = torch.zeros((n, width), dtype=torch.float32)
    positions = torch.arange(width)[None, :].expand(n, width)
    last = torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=1).values
    has = last >= 0
    out[has.nonzero().squeeze(-1), last[has]] = rewards.to(torch.float32)[has]
    if token_kl is not None and kl_coef:
        out = out - kl_coef * token_kl.to(torch.float32) * m
    return out


def gae_advantages_and_returns(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both ``[N, L]`` and 0 outside ``mask``; the advantages
    whitened over ``mask`` unless ``whiten`` is false. See the module docstring."""
    if not (token_rewards.shape == values.shape == mask.shape) or mask.dim() != 2:
        raise ValueError(
            f"token_rewards {tuple(token_rewards.shape)}, values {tuple(values.shape)} and mask "
            f"{tuple(mask.shape)} must be the same [N, L]"
        )
    m = mask.to(torch.float32)
    r = token_rewards.to(torch.float32) * m
    v = values.to(torch.float32).detach() * m
    n, width = m.shape
    next_value = torch.zeros(n)
    running = torch.zeros(n)
    adv = torch.zeros((n, width))
    for t in reversed(range(width)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        gae_t = delta + gamma * lam * running
        next_value = v[:, t] * m[:, t] + (1.0 - m[:, t]) * next_value
        running = gae_t * m[:, t] + (1.0 - m[:, t]) * running
        adv[:, t] = running
    adv = adv * m
    returns = (adv + v) * m
    return (masked_whiten(adv, mask) if whiten else adv), returns


@dataclass(frozen=True)
class ValueLoss:
    """The critic's loss per token and where the clipped term was the larger one."""

    loss: torch.Tensor  # [B, T], to minimise
    clipped: torch.Tensor  # [B, T] bool


def value_loss_per_token(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float | None
) -> ValueLoss:
    """0.5 * max((V - R)^2, (V_clip - R)^2) with V_clip = old + clamp(V - old, -c, c)
    (PPO's clipped value loss, verl's ``compute_value_loss``); without ``value_clip``
    0.5 * (V - R)^2. ``old_values`` are the critic's at the start of the step."""
    unclipped = (values - returns) ** 2
    if value_clip is None:
        return ValueLoss(0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool))
    if value_clip <= 0:
        raise ValueError(f"value_clip must be > 0, got {value_clip}")
    v_clip = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    clipped = (v_clip - returns) ** 2
    return ValueLoss(0.5 * torch.maximum(unclipped, clipped), clipped > unclipped)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over ``mask`` (population variances): 1 is a perfect
    critic, 0 one no better than the mean return. 0 when the returns do not vary."""
    diff = returns - values
    var_r = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    var_d = masked_mean((diff - masked_mean(diff, mask)) ** 2, mask)
    if float(var_r) <= 1e-12:
        return 0.0
    return float(1.0 - var_d / var_r)
