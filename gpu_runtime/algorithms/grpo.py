"""The GRPO names, kept importable: advantages live in ``advantages``, losses in
``losses`` and the policy's log-probabilities in ``logprobs``."""

from __future__ import annotations

from gpu_runtime.algorithms.advantages import group_advantages
from gpu_runtime.algorithms.logprobs import logprobs_and_logits, token_logprobs
from gpu_runtime.algorithms.losses import entropy_from_logits, kl_k3, masked_mean, ppo_clip_loss

__all__ = [
    "entropy_from_logits", "group_advantages", "kl_k3", "logprobs_and_logits", "masked_mean", "ppo_clip_loss",
    "token_logprobs",
]
