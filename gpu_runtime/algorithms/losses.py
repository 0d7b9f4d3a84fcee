"""Policy losses, KL estimators, entropy, truncated IS and loss aggregation.

Every function works on ``[B, T]`` per-token tensors (``T``: next-token
positions, ``mask`` true on response tokens) and returns per-token terms; the
trainer turns them into one number with an ``Aggregation``, whose micro-batch
shares add up to the loss of the whole batch (so micro-batching never changes
the loss or the gradient). ``advantages`` is ``[B]`` (one per sequence,
broadcast over its tokens) or ``[B, T]``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
LOSS_AGGS: tuple[LossAgg, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
KLEstimator = Literal["k1", "k2", "k3"]


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``x`` over ``mask`` divided by the mask's count (0 when the mask is empty)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1.0)


def _per_token(advantages: torch.Tensor) -> torch.Tensor:
    return advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages


# ---- policy losses ------------------------------------------------------------------
@dataclass(frozen=True)
class TokenLoss:
    """A policy loss per token, and where its clipping was active."""

    loss: torch.Tensor  # [B, T], to minimise
    clipped: torch.Tensor  # [B, T] bool: the clipped term / the truncated weight was the active one
    dual_clipped: torch.Tensor | None = None  # [B, T] bool: dual-clip bound active (None: dual clip off)


def _clipped_surrogate(adv: torch.Tensor, ratio: torch.Tensor, clip_eps: float,
                       clip_eps_high: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate max(-A * r, -A * clamp(r, 1 - clip_eps, 1 + clip_eps_high))
    per token, and where the clipped term was the active one (``clip_eps_high``: ``clip_eps`` when unset)."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    return torch.maximum(pg1, pg2), pg2 > pg1


def ppo_clip_per_token(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_eps: float,
                       clip_eps_high: float | None = None, dual_clip_c: float | None = None) -> TokenLoss:
    """PPO clipped surrogate. ratio = exp(logprobs - old_logprobs);
    loss = max(-A * ratio, -A * clamp(ratio, 1 - clip_eps, 1 + clip_eps_high)),
    ``clip_eps_high`` defaulting to ``clip_eps`` (DAPO clip-higher sets it higher).
    Dual clip (``dual_clip_c`` = c > 1, Ye et al. 2019): for A < 0 the loss is also
    capped at -A * c, so a huge ratio on a bad token cannot blow the loss up."""
    adv = _per_token(advantages)
    loss, clipped = _clipped_surrogate(adv, torch.exp(logprobs - old_logprobs), clip_eps, clip_eps_high)
    if dual_clip_c is None:
        return TokenLoss(loss, clipped)
    if dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    pg3 = -adv * dual_clip_c
    negative = adv < 0
    dual = negative & (loss > pg3)
    return TokenLoss(torch.where(negative, torch.minimum(loss, pg3), loss), clipped, dual)


def gspo_per_token(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   clip_eps: float, clip_eps_high: float | None = None) -> TokenLoss:
    """GSPO (Zheng et al. 2025), token form. The sequence ratio
    s_i = exp(mean over the sample's response tokens of (logprobs - old_logprobs));
    per token s_it = sg[s_i] * p_t / sg[p_t] (value s_i, gradient s_i * grad log p_t)
    goes through PPO's clip: loss = max(-A * s_it, -A * clamp(s_it, 1 - clip_eps,
    1 + clip_eps_high)). With the ``seq_mean_token_mean`` aggregation and one
    advantage per sequence this is the paper's sequence-level objective; its clip
    ranges are small (the paper: 3e-4 low, 4e-4 high)."""
    m = mask.to(logprobs.dtype)
    log_s = ((logprobs - old_logprobs) * m).sum(-1) / m.sum(-1).clamp(min=1.0)
    s = torch.exp(logprobs - logprobs.detach() + log_s.detach().unsqueeze(-1))
    return TokenLoss(*_clipped_surrogate(_per_token(advantages), s, clip_eps, clip_eps_high))


def cispo_per_token(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_eps_high: float
) -> TokenLoss:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient IS weight,
    loss = -sg(min(ratio, 1 + clip_eps_high)) * A * logprobs. No lower bound, and a
    truncated token still gets a gradient (PPO's clip would drop it)."""
    ratio = torch.exp(logprobs - old_logprobs)
    upper = 1.0 + clip_eps_high
    weight = torch.clamp(ratio, max=upper).detach()
    return TokenLoss(-weight * _per_token(advantages) * logprobs, ratio > upper)


def policy_loss_per_token(estimator: str, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                          mask: torch.Tensor, *, clip_eps: float, clip_eps_high: float | None = None,
                          dual_clip_c: float | None = None) -> TokenLoss:
    """The policy loss of ``train.estimator``: GSPO's and CISPO's own, PPO-clip for the
    rest. CISPO's IS weight is capped at ``1 + clip_eps_high`` (``clip_eps`` when unset)."""
    if estimator == "gspo":
        return gspo_per_token(logprobs, old_logprobs, advantages, mask, clip_eps, clip_eps_high)
    if estimator == "cispo":
        return cispo_per_token(logprobs, old_logprobs, advantages, clip_eps if clip_eps_high is None else clip_eps_high)
    return ppo_clip_per_token(logprobs, old_logprobs, advantages, clip_eps, clip_eps_high, dual_clip_c)


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ppo_clip_per_token`` as a token mean over ``mask``: (loss, clip_fraction)."""
    t = ppo_clip_per_token(logprobs, old_logprobs, advantages, clip_eps, clip_eps_high)
    return masked_mean(t.loss, mask), masked_mean(t.clipped.to(t.loss.dtype), mask).detach()


# ---- KL, entropy, truncated IS -----------------------------------------------------
def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Schulman's estimators of KL(policy || ref) per token, with d = ref - logprobs:
    k1 = -d (unbiased, can be negative), k2 = d^2 / 2 (its gradient is the KL's on
    samples of the policy), k3 = exp(d) - d - 1 (unbiased, >= 0)."""
    if estimator == "k1":
        return logprobs - ref_logprobs
    if estimator == "k2":
        return 0.5 * (logprobs - ref_logprobs) ** 2
    if estimator == "k3":
        d = ref_logprobs - logprobs
        return torch.exp(d) - d - 1.0
    raise ValueError(f"kl_estimator must be k1, k2 or k3, got {estimator!r}")


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The k3 estimate as a token mean over ``mask``."""
    return masked_mean(kl_per_token(logprobs, ref_logprobs, "k3"), mask)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy ``[...]`` of the categorical given by ``logits [..., V]``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def tis_weights(old_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling against the engine that generated the samples:
    w = min(exp(old_logprobs - engine_logprobs), cap), detached; also where it was
    truncated. ``old_logprobs`` are the trainer's, under the same weights."""
    raw = torch.exp(old_logprobs.detach() - engine_logprobs.detach())
    return torch.clamp(raw, max=cap), raw > cap


# ---- aggregation --------------------------------------------------------------------
@dataclass(frozen=True)
class Aggregation:
    """How per-token terms become the batch's loss (``train.loss_agg``):

    - ``token_mean``: sum over every response token of the batch / their count
    - ``seq_mean_token_mean``: mean over samples of each sample's token mean
    - ``seq_mean_token_sum``: mean over samples of each sample's token sum
    - ``seq_mean_token_sum_norm``: ``seq_mean_token_sum / norm_len`` (Dr. GRPO: a
      constant, so a sample's weight does not depend on its length)

    Samples without a response token count for nothing. Built over the masks of
    the whole batch; a micro-batch adds ``value(x, mask) * weight(mask)``."""

    mode: LossAgg
    n_tokens: int  # response tokens in the batch
    n_seqs: int  # samples of the batch with at least one response token
    norm_len: int | None = None

    @classmethod
    def over(cls, masks: Iterable[torch.Tensor], mode: LossAgg, norm_len: int | None = None) -> Aggregation:
        if mode not in LOSS_AGGS:
            raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGGS)}, got {mode!r}")
        if mode == "seq_mean_token_sum_norm" and (norm_len is None or norm_len < 1):
            raise ValueError(f"loss_agg seq_mean_token_sum_norm needs norm_len >= 1, got {norm_len}")
        masks = list(masks)
        return cls(mode, sum(int(m.sum()) for m in masks), sum(int((m.sum(-1) > 0).sum()) for m in masks), norm_len)

    def value(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The micro-batch's own aggregate of ``x [B, T]`` (0 when ``mask`` is empty)."""
        if self.mode == "token_mean":
            return masked_mean(x, mask)
        m = mask.to(x.dtype)
        counts = m.sum(-1)
        per_seq = (x * m).sum(-1)
        if self.mode == "seq_mean_token_mean":
            per_seq = per_seq / counts.clamp(min=1.0)
        value = per_seq.sum() / (counts > 0).sum().clamp(min=1).to(x.dtype)
        if self.mode == "seq_mean_token_sum_norm":
            assert self.norm_len is not None
            value = value / self.norm_len
        return value

    def weight(self, mask: torch.Tensor) -> float:
        """The micro-batch's share of the batch: its tokens (``token_mean``) or samples."""
        if self.mode == "token_mean":
            return float(mask.sum()) / max(self.n_tokens, 1)
        return float((mask.sum(-1) > 0).sum()) / max(self.n_seqs, 1)

    def __call__(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The micro-batch's share of the batch's aggregate: ``value * weight``."""
        return self.value(x, mask) * self.weight(mask)


def aggregate(x: torch.Tensor, mask: torch.Tensor, mode: LossAgg, norm_len: int | None = None) -> torch.Tensor:
    """``x [B, T]`` over ``mask`` as one batch, aggregated by ``mode``."""
    return Aggregation.over([mask], mode, norm_len).value(x, mask)
