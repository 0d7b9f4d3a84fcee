"""The GRPO policy gradient over a Megatron-core GPTModel: the single trainer's loss
(``PolicyTrainer.train_step`` with one epoch, no KL, no entropy bonus, no truncated IS)
computed from the GPTModel's logits, so the two can be compared term by term.

The loss of ``trainer.backend: megatron`` (``megatron.trainer.MegatronTrainer``): the batches,
advantages, per-token loss and aggregation are the repo's own (``trainer.common.batches``,
``algorithms.losses``); only the forward differs. Needs CUDA to run (megatron-core has
no CPU forward); checked against the HF trainer by ``tests/integration/test_cuda_paths.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_runtime.algorithms.logprobs import target_logprobs
from gpu_runtime.algorithms.losses import Aggregation, entropy_from_logits, masked_mean, policy_loss_per_token
from gpu_runtime.models.causal_lm import positions_from_mask
from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.common.batches import logprob_gap_sums, micro_batch_advantages, micro_batches
from spec.train import TrainSpec
from spec.trainer import megatron_train_conflicts


def gpt_logprobs_and_logits(gpt: Any, ids: torch.Tensor, mask: torch.Tensor,
                            temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T-1]`` log p(ids[:, j+1] | ids[:, :j+1]) of a right-padded batch at ``temperature``
    (the rollout's), and the float logits ``[B, T-1, V]`` (divided by it) behind them. Causal
    attention alone suffices: padding only ever follows a sample's real tokens."""
    pos = positions_from_mask(mask.to(torch.bool))
    logits = gpt(input_ids=ids, position_ids=pos, attention_mask=None).float()[:, :-1]
    return target_logprobs(logits, ids[:, 1:], temperature)


def grpo_backward(gpt: Any, samples: list[Sample], rewards: list[float], group_size: int, hp: TrainSpec,
                  pad_id: int, temperature: float = 1.0) -> dict[str, float]:
    """Accumulate the step's policy gradient into ``gpt``'s ``.grad``s. Returns the step's
    metric sums as ``PolicyTrainer.train_step`` reports them (``loss``, ``pg_loss``, ``kl``,
    ``entropy``, ``clip_fraction``, ``tokens``) plus the train-inference logprob gap's
    ``gap_total`` / ``gap_count`` / ``gap_max``."""
    if bad := megatron_train_conflicts(hp):
        raise ValueError(f"the megatron GRPO loss does not implement {'; '.join(bad)}")
    device = next(gpt.parameters()).device
    batches = micro_batches(samples, hp.micro_batch_size, pad_id)
    agg = Aggregation.over([b.tmask for b in batches], hp.loss_agg, hp.loss_agg_norm_len)
    advs = micro_batch_advantages(batches, torch.tensor(rewards, dtype=torch.float32), group_size, hp)
    sums = {"loss": 0.0, "entropy": 0.0, "clip_fraction": 0.0}
    if hp.dual_clip_c is not None:
        sums["dual_clip_fraction"] = 0.0
    old_lps: list[torch.Tensor | None] = []
    for b, adv in zip(batches, advs):
        tmask = b.tmask.to(device)
        lp, logits = gpt_logprobs_and_logits(gpt, b.ids.to(device), b.mask.to(device), temperature)
        old_lps.append(lp.detach().to(b.tmask.device))  # where the batch's masks are (the gap's inputs)
        terms = policy_loss_per_token(hp.estimator, lp, lp.detach(), adv.to(device), tmask, clip_eps=hp.clip_eps,
                                      clip_eps_high=hp.clip_eps_high, dual_clip_c=hp.dual_clip_c)
        w = agg.weight(tmask)
        loss = agg.value(terms.loss, tmask) * w
        loss.backward()
        with torch.no_grad():
            ent = agg.value(entropy_from_logits(logits.detach()), tmask)
        share = float(tmask.sum()) / max(agg.n_tokens, 1)
        sums["loss"] += float(loss.detach())
        sums["entropy"] += float(ent) * w
        sums["clip_fraction"] += float(masked_mean(terms.clipped.to(lp.dtype), tmask)) * share
        if terms.dual_clipped is not None:
            sums["dual_clip_fraction"] += float(masked_mean(terms.dual_clipped.to(lp.dtype), tmask)) * share
    return {**sums, "pg_loss": sums["loss"], "kl": 0.0, "tokens": float(agg.n_tokens),
            **logprob_gap_sums(batches, old_lps)}


def grpo_step(gpt: Any, optimizer: torch.optim.Optimizer, samples: list[Sample], rewards: list[float],
              group_size: int, hp: TrainSpec, pad_id: int, temperature: float = 1.0) -> dict[str, float]:
    """One optimizer step (grad norm clipped to ``hp.grad_clip``, as the single trainer)."""
    optimizer.zero_grad(set_to_none=True)
    sums = grpo_backward(gpt, samples, rewards, group_size, hp, pad_id, temperature)
    norm = float(torch.nn.utils.clip_grad_norm_([p for p in gpt.parameters() if p.requires_grad], hp.grad_clip))
    optimizer.step()
    return {**sums, "grad_norm": norm}
