"""One RL train step of the HF policy, in its parts (``PolicyTrainer.train_step`` drives them).

``plan_step`` computes what the step needs before its first update: the micro-batches and
the loss aggregation, the KL reference's logprobs, the "old" logprobs (when the KL is part
of the reward or the run distills: the current weights' own, without grad), and the
advantages: the estimator's, or GAE from the PPO critic's old values, plus the teacher's
per-token term when distilling. ``micro_batch_backward`` then back-propagates one
micro-batch's share of the loss (policy, KL, entropy; and the critic's value loss), and in
the last epoch adds its metric shares to the step's sums. Every logprob and entropy of the
policy and of the reference is of ``logits / temperature`` (the rollout's: the policy that
sampled); the teacher's are its own at 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from gpu_runtime.algorithms.logprobs import logprobs_and_logits
from gpu_runtime.algorithms.losses import (
    Aggregation,
    TokenLoss,
    entropy_from_logits,
    kl_per_token,
    masked_mean,
    policy_loss_per_token,
    tis_weights,
)
from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.common.batches import MicroBatch, logprob_gap_sums, micro_batch_advantages, micro_batches
from gpu_runtime.trainer.policy.critic import Critic
from gpu_runtime.trainer.policy.distill import Teacher, distill_terms
from gpu_runtime.trainer.policy.ppo import CriticPass
from spec.train import TrainSpec


@dataclass
class StepPlan:
    batches: list[MicroBatch]
    agg: Aggregation
    ref_lps: list[torch.Tensor | None]  # the KL reference's, per micro-batch (None: no KL)
    old_lps: list[torch.Tensor | None]  # filled by the first epoch's forwards unless computed first
    reward_kl: list[torch.Tensor] | None  # the KL penalty of the reward, per micro-batch
    advantages: list[torch.Tensor]
    critic: CriticPass | None  # estimator ppo
    distill_kl: float | None  # distilling: the step's reverse KL to the teacher
    temperature: float  # rollout.temperature: the policy's (and reference's) logprobs are of logits / it
    tis: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # by micro-batch

    @property
    def trains_policy(self) -> bool:
        """False while the PPO critic warms up (``critic_warmup_steps``: only the critic steps)."""
        return self.critic is None or self.critic.trains_policy

    def first_sums(self, hp: TrainSpec, own: list[int]) -> dict[str, float]:
        """The step's metric sums before the last epoch adds to them; the reward's KL is known
        already (over the micro-batches ``own``: a cell adds its ranks' shares)."""
        sums = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip_fraction": 0.0}
        if hp.dual_clip_c is not None:
            sums["dual_clip_fraction"] = 0.0
        if self.reward_kl is not None:
            sums["kl"] = sum(float(self.agg(self.reward_kl[k], self.batches[k].tmask)) for k in own)
        return sums

    def local_sums(self, sums: dict[str, float]) -> dict[str, float]:
        """This process's complete loss sums, plus the rollout-logprob gap and the TIS weights
        of its micro-batches (token-share weighted: a cell adds its ranks' sums)."""
        if self.tis:
            n_tokens = self.agg.n_tokens
            shares = {k: float(self.batches[k].tmask.sum()) / max(n_tokens, 1) for k in self.tis}
            sums["tis_weight_mean"] = sum(float(masked_mean(wt, self.batches[k].tmask)) * shares[k]
                                          for k, (wt, _) in self.tis.items())
            sums["tis_clip_fraction"] = sum(float(masked_mean(c.to(torch.float32), self.batches[k].tmask)) * shares[k]
                                            for k, (_, c) in self.tis.items())
        return {**sums, **logprob_gap_sums(self.batches, self.old_lps)}

    def extra_metrics(self, hp: TrainSpec) -> dict[str, float]:
        """The critic's and the distillation's metrics of the step."""
        extra = self.critic.metrics(hp, self.agg.n_tokens) if self.critic is not None else {}
        if self.distill_kl is not None:
            extra["distill_kl"] = self.distill_kl
        return extra


def _logprobs(model: PreTrainedModel, batches: list[MicroBatch], precision: str,
              temperature: float) -> list[torch.Tensor]:
    with torch.no_grad():
        return [logprobs_and_logits(model, b.ids, b.mask, precision, temperature)[0] for b in batches]


def plan_step(
    model: PreTrainedModel, ref_model: PreTrainedModel | None, critic: Critic | None, teacher: Teacher | None,
    samples: list[Sample], rewards: list[float], group_size: int, hp: TrainSpec, pad_id: int,
    temperature: float = 1.0,
) -> StepPlan:
    """Everything the step computes before its first update (see the module doc). The policy's
    and the KL reference's logprobs are taken at the rollout's ``temperature``; the teacher's
    (distillation) at 1: it is scored as itself."""
    r = torch.tensor(rewards, dtype=torch.float32)
    batches = micro_batches(samples, hp.micro_batch_size, pad_id)
    agg = Aggregation.over([b.tmask for b in batches], hp.loss_agg, hp.loss_agg_norm_len)
    ref_lps: list[torch.Tensor | None] = [None] * len(batches)
    if hp.kl_coef > 0:
        assert ref_model is not None
        ref_lps = list(_logprobs(ref_model, batches, hp.precision, temperature))
    old_lps: list[torch.Tensor | None] = [None] * len(batches)
    first: list[torch.Tensor] = []  # the old logprobs, when the advantages need them first
    reward_kl: list[torch.Tensor] | None = None
    kl_in_reward = hp.kl_in_reward and hp.kl_coef > 0
    if kl_in_reward or teacher is not None:
        first = _logprobs(model, batches, hp.precision, temperature)
        old_lps = list(first)
    if kl_in_reward:
        reward_kl = [kl_per_token(old, ref, hp.kl_estimator) for old, ref in zip(first, ref_lps) if ref is not None]
    critic_pass: CriticPass | None = None
    if critic is not None:
        critic_pass = CriticPass.start(critic, batches, r, hp, reward_kl)
        advs = critic_pass.advantages
    else:
        advs = micro_batch_advantages(batches, r, group_size, hp, reward_kl)
    distill_kl: float | None = None
    if teacher is not None:
        terms, distill_kl = distill_terms(teacher.model, batches, first, teacher.coef, hp.precision)
        advs = [a + t for a, t in zip(advs, terms)]
    return StepPlan(batches, agg, ref_lps, old_lps, reward_kl, advs, critic_pass, distill_kl, temperature)


@dataclass
class MicroBatchLoss:
    """One micro-batch's loss (its own aggregate) and the terms its metrics are made of."""

    loss: torch.Tensor
    pg: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor | None  # computed with grad only when it is part of the loss
    weight: float  # the micro-batch's share of the batch
    terms: TokenLoss
    logprobs: torch.Tensor
    logits: torch.Tensor


def micro_batch_loss(model: PreTrainedModel, plan: StepPlan, k: int, hp: TrainSpec) -> MicroBatchLoss:
    """Micro-batch ``k``'s forward and loss: the estimator's policy loss (TIS-weighted with
    ``tis_cap``), the KL to the reference unless it is part of the reward, the entropy bonus."""
    b, agg = plan.batches[k], plan.agg
    tmask = b.tmask
    lp, logits = logprobs_and_logits(model, b.ids, b.mask, hp.precision, plan.temperature)
    if plan.old_lps[k] is None:
        plan.old_lps[k] = lp.detach()
    old = plan.old_lps[k]
    assert old is not None
    if hp.tis_cap is not None and k not in plan.tis:
        plan.tis[k] = tis_weights(old, b.engine_logprobs(), hp.tis_cap)
    terms = policy_loss_per_token(hp.estimator, lp, old, plan.advantages[k], tmask, clip_eps=hp.clip_eps,
                                  clip_eps_high=hp.clip_eps_high, dual_clip_c=hp.dual_clip_c)
    per_token = terms.loss * plan.tis[k][0] if plan.tis else terms.loss
    pg = agg.value(per_token, tmask)
    loss = pg
    kl = torch.zeros(())
    ref = plan.ref_lps[k]
    if ref is not None and plan.reward_kl is None:
        kl = agg.value(kl_per_token(lp, ref, hp.kl_estimator), tmask)
        loss = loss + hp.kl_coef * kl
    ent: torch.Tensor | None = None
    if hp.entropy_coef > 0:
        ent = agg.value(entropy_from_logits(logits), tmask)
        loss = loss - hp.entropy_coef * ent
    return MicroBatchLoss(loss, pg, kl, ent, agg.weight(tmask), terms, lp, logits)


def record(sums: dict[str, float], mb: MicroBatchLoss, tmask: torch.Tensor, agg: Aggregation,
           with_kl: bool) -> None:
    """Add a micro-batch's metric shares to the step's ``sums`` (``with_kl``: the KL is the
    loss's, not the reward's); fractions are token shares."""
    ent = mb.entropy
    if ent is None:
        with torch.no_grad():
            ent = agg.value(entropy_from_logits(mb.logits.detach()), tmask)
    share = float(tmask.sum()) / max(agg.n_tokens, 1)
    values = [("loss", mb.loss, mb.weight), ("pg_loss", mb.pg, mb.weight), ("entropy", ent, mb.weight),
              ("clip_fraction", masked_mean(mb.terms.clipped.to(mb.logprobs.dtype), tmask), share)]
    if with_kl:
        values.append(("kl", mb.kl, mb.weight))
    if mb.terms.dual_clipped is not None:
        values.append(("dual_clip_fraction", masked_mean(mb.terms.dual_clipped.to(mb.logprobs.dtype), tmask), share))
    for name, v, weight in values:
        sums[name] += float(v.detach()) * weight


def micro_batch_backward(model: PreTrainedModel, plan: StepPlan, k: int, hp: TrainSpec,
                         sums: dict[str, float] | None) -> None:
    """Micro-batch ``k``'s share of the loss into the policy's grads (unless the critic warms
    up) and of the value loss into the critic's; ``sums`` (the last epoch): its metrics too."""
    mb = micro_batch_loss(model, plan, k, hp)
    b = plan.batches[k]
    if plan.trains_policy:
        (mb.loss * mb.weight).backward()
    if plan.critic is not None:
        plan.critic.backward(k, b, plan.agg, hp, record=sums is not None)
    if sums is not None:
        record(sums, mb, b.tmask, plan.agg, with_kl=plan.reward_kl is None)


__all__ = ["MicroBatchLoss", "StepPlan", "micro_batch_backward", "micro_batch_loss", "plan_step", "record"]
