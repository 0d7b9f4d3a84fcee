"""The critic's part of one ``ppo`` train step (``PolicyTrainer.train_step`` drives it).

At the start of the step, before any update, the critic scores the batch without
grad (the "old" values, as verl computes them); with the token rewards (the outcome
reward on each sample's last response token, minus the per-token KL when
``kl_in_reward``) they give the GAE advantages the policy loss uses and the returns
the critic regresses on. Then, per PPO epoch and micro-batch, the clipped value loss
(aggregated like the policy loss, ``train.loss_agg``) is back-propagated into the
critic, which takes one AdamW step per epoch alongside the policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gpu_runtime.algorithms.gae import (
    explained_variance,
    gae_advantages_and_returns,
    token_level_rewards,
    value_loss_per_token,
)
from gpu_runtime.algorithms.losses import Aggregation, masked_mean
from gpu_runtime.trainer.common.batches import MicroBatch, response_aligned_mask
from gpu_runtime.trainer.policy.critic import Critic, critic_lr
from spec.train import TrainSpec


@dataclass
class CriticPass:
    critic: Critic
    old_values: list[torch.Tensor]  # per micro-batch, [B, T-1]
    advantages: list[torch.Tensor]  # per micro-batch, [B, T-1] (whitened GAE)
    returns: list[torch.Tensor]  # per micro-batch, [B, T-1]
    explained_variance: float
    trains_policy: bool  # false during critic_warmup_steps
    sums: dict[str, float] = field(default_factory=lambda: {"value_loss": 0.0, "value_clip_fraction": 0.0})
    grad_norm: float = 0.0

    @classmethod
    def start(
        cls, critic: Critic, batches: list[MicroBatch], rewards: torch.Tensor, hp: TrainSpec,
        reward_kl: list[torch.Tensor] | None,
    ) -> CriticPass:
        """Old values, token rewards, GAE advantages and returns of the whole batch."""
        with torch.no_grad():
            old = [critic.model(b.ids, b.mask) * b.tmask for b in batches]
        samples = [s for b in batches for s in b.samples]
        rmask = response_aligned_mask(samples)
        width = rmask.shape[1]
        values = torch.cat([b.to_response(v, width) for b, v in zip(batches, old)])
        token_kl = None if reward_kl is None else torch.cat([b.to_response(kl, width) for b, kl in zip(batches, reward_kl)])
        rewards_t = token_level_rewards(rewards, rmask, token_kl, hp.kl_coef)
        adv, ret = gae_advantages_and_returns(rewards_t, values, rmask, hp.gamma, hp.lam)
        advs, rets, i = [], [], 0
        for b in batches:
            n = len(b.samples)
            advs.append(b.from_response(adv[i : i + n]))
            rets.append(b.from_response(ret[i : i + n]))
            i += n
        return cls(critic, old, advs, rets, explained_variance(values, ret, rmask),
                   trains_policy=critic.steps >= hp.critic_warmup_steps)

    def backward(self, k: int, batch: MicroBatch, agg: Aggregation, hp: TrainSpec, record: bool) -> None:
        """Micro-batch ``k``'s share of ``vf_coef`` * the value loss into the critic's grads."""
        values = self.critic.model(batch.ids, batch.mask)
        terms = value_loss_per_token(values, self.old_values[k], self.returns[k], hp.value_clip)
        loss = agg.value(terms.loss, batch.tmask)
        (hp.vf_coef * loss * agg.weight(batch.tmask)).backward()
        if record:
            share = float(batch.tmask.sum()) / max(agg.n_tokens, 1)
            self.sums["value_loss"] += float(loss.detach()) * agg.weight(batch.tmask)
            self.sums["value_clip_fraction"] += float(masked_mean(terms.clipped.float(), batch.tmask)) * share

    def metrics(self, hp: TrainSpec, n_tokens: int) -> dict[str, float]:
        """The step's critic metrics: value loss and clip fraction of the last epoch, the
        explained variance and token means of the old values and returns."""
        values = sum(float(v.sum()) for v in self.old_values) / max(n_tokens, 1)
        returns = sum(float(r.sum()) for r in self.returns) / max(n_tokens, 1)
        return {**self.sums, "explained_variance": self.explained_variance, "critic_grad_norm": self.grad_norm,
                "critic_lr": critic_lr(hp), "value_mean": values, "return_mean": returns,
                "critic_steps": float(self.critic.steps)}
