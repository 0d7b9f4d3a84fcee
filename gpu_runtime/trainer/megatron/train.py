"""The GRPO policy gradient over a Megatron-core GPTModel: the single trainer's loss
(``PolicyTrainer.train_step`` with one epoch, no KL, no entropy bonus, no truncated IS)
computed from the GPTModel's logits, so the two can be compared term by term.

Groundwork for ``trainer.backend: megatron`` (not a config value yet): the batches,
advantages, per-token loss and aggregation are the repo's own (``trainer.batches``,
``algorithms.losses``); only the forward differs. Needs CUDA to run (megatron-core has
no CPU forward); checked against the HF trainer by ``tests/integration/test_cuda_paths.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_runtime.algorithms.losses import Aggregation, policy_loss_per_token
from gpu_runtime.models.causal_lm import positions_from_mask
from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.api import TrainerHParams
from gpu_runtime.trainer.batches import micro_batch_advantages, micro_batches


def gpt_logprobs(gpt: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T-1]`` log p(ids[:, j+1] | ids[:, :j+1]) of a right-padded batch. Causal
    attention alone suffices: padding only ever follows a sample's real tokens."""
    pos = positions_from_mask(mask.to(torch.bool))
    logits = gpt(input_ids=ids, position_ids=pos, attention_mask=None).float()[:, :-1]
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def unsupported(hp: TrainerHParams) -> list[str]:
    """The knobs this loss does not implement yet, set away from what it computes."""
    bad = []
    if hp.kl_coef > 0:
        bad.append("kl_coef > 0")
    if hp.entropy_coef > 0:
        bad.append("entropy_coef > 0")
    if hp.tis_cap is not None:
        bad.append("tis_cap")
    if hp.ppo_epochs != 1:
        bad.append("ppo_epochs != 1")
    if hp.estimator == "ppo":
        bad.append("estimator ppo")
    return bad


def grpo_backward(gpt: Any, samples: list[Sample], rewards: list[float], group_size: int, hp: TrainerHParams,
                  pad_id: int) -> float:
    """Accumulate the step's policy gradient into ``gpt``'s ``.grad``s; returns the loss."""
    if bad := unsupported(hp):
        raise ValueError(f"the megatron GRPO loss does not implement {', '.join(bad)}")
    device = next(gpt.parameters()).device
    batches = micro_batches(samples, hp.micro_batch_size, pad_id)
    agg = Aggregation.over([b.tmask for b in batches], hp.loss_agg, hp.loss_agg_norm_len)
    advs = micro_batch_advantages(batches, torch.tensor(rewards, dtype=torch.float32), group_size, hp)
    total = 0.0
    for b, adv in zip(batches, advs):
        tmask = b.tmask.to(device)
        lp = gpt_logprobs(gpt, b.ids.to(device), b.mask.to(device))
        terms = policy_loss_per_token(hp.estimator, lp, lp.detach(), adv.to(device), tmask, clip_eps=hp.clip_eps,
                                      clip_eps_high=hp.clip_eps_high, dual_clip_c=hp.dual_clip_c)
        w = agg.weight(tmask)
        loss = agg.value(terms.loss, tmask) * w
        loss.backward()
        total += float(loss.detach())
    return total


def grpo_step(gpt: Any, optimizer: torch.optim.Optimizer, samples: list[Sample], rewards: list[float],
              group_size: int, hp: TrainerHParams, pad_id: int) -> dict[str, float]:
    """One optimizer step (grad norm clipped to ``hp.grad_clip``, as the single trainer)."""
    optimizer.zero_grad(set_to_none=True)
    loss = grpo_backward(gpt, samples, rewards, group_size, hp, pad_id)
    norm = float(torch.nn.utils.clip_grad_norm_([p for p in gpt.parameters() if p.requires_grad], hp.grad_clip))
    optimizer.step()
    return {"loss": loss, "grad_norm": norm}
