"""Supervised fine-tuning of the policy: the warm-up that makes version 0, and SFT mode's step.

Each row becomes a sample ``prompt -> sft_target(row) + EOS`` (the prompt encoded as the
engines see it); the loss is the negative log-likelihood of the target tokens only. The
warm-up takes ``sft.steps`` AdamW steps at a constant LR over batches drawn from the seed
(token mean). SFT mode's update aggregates by ``train.loss_agg`` (token mean by default)
over micro-batches of ``train.micro_batch_size``, with the run's AdamW, LR schedule and grad
clip, and ``train.ppo_epochs`` optimizer steps per batch. The forward runs in
``train.precision`` (``gpu_runtime.models.precision``).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from gpu_runtime.algorithms.logprobs import logprobs_and_logits
from gpu_runtime.algorithms.losses import Aggregation, masked_mean
from gpu_runtime.data.datasets import encode_prompt, sft_target
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.store.artifacts import Sample, derive_seed
from gpu_runtime.trainer.common import lora as lora_lib
from gpu_runtime.trainer.common.batches import micro_batches, pad_batch, response_mask
from gpu_runtime.trainer.common.optim import AdamWSteps
from spec.train import TrainSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def hf_model(policy: AdamWSteps) -> PreTrainedModel:
    """The policy's model as the Hugging Face causal LM it is here: SFT trains ``PolicyTrainer``'s
    (``AdamWSteps`` also serves megatron's GPTModel, which has SFT steps of its own)."""
    return cast("PreTrainedModel", policy.model)


@dataclass(frozen=True)
class Warmup:
    """What the warm-up's ``sft.*`` settings ask for (``grad_clip`` None: no clipping)."""

    steps: int
    batch_size: int
    lr: float
    seed: int
    grad_clip: float | None
    betas: tuple[float, float]


def warmup(policy: AdamWSteps, tokenizer: Tokenizer, rows: list[dict], w: Warmup,
           hp: TrainSpec) -> tuple[float, float, float]:
    """``w.steps`` supervised steps of ``policy.model`` on ``rows`` with an AdamW of its own
    (``w.betas``, constant ``w.lr``): the first and last losses and the seconds they took."""
    if not rows:
        raise ValueError("sft rows must not be empty")
    if w.steps < 0 or w.batch_size <= 0:
        raise ValueError(f"sft steps must be >= 0 and sft batch_size > 0, got {w.steps}, {w.batch_size}")
    encoded = [(encode_prompt(tokenizer, r), tokenizer.encode(sft_target(r)) + [tokenizer.eos_token_id]) for r in rows]
    opt = policy.new_optimizer(hp.model_copy(update={"betas": w.betas}), lr=w.lr)
    policy.model.train()
    t0 = time.perf_counter()
    first = last = float("nan")
    for step in range(w.steps):
        rng = random.Random(derive_seed("sft", w.seed, step))
        batch = [encoded[rng.randrange(len(encoded))] for _ in range(w.batch_size)]
        ids, mask = pad_batch([p + c for p, c in batch], tokenizer.pad_token_id)
        tmask = response_mask([len(p) for p, _ in batch], [len(p) + len(c) for p, c in batch], ids.shape[1] - 1)
        lp, _ = logprobs_and_logits(hf_model(policy), ids, mask, hp.precision)
        loss = -masked_mean(lp, tmask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if w.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(lora_lib.trainable_parameters(policy.model), w.grad_clip)
        opt.step()
        last = float(loss.detach())
        if step == 0:
            first = last
    return first, last, time.perf_counter() - t0


def sft_samples(tokenizer: Tokenizer, rows: list[dict], version: int) -> list[Sample]:
    """Each row as a sample whose response is its SFT target and EOS."""
    if not rows:
        raise ValueError("an SFT step needs at least one row")
    return [
        Sample(sample_id=str(r["id"]), prompt_index=i, group_index=0, prompt_ids=encode_prompt(tokenizer, r),
               response_ids=tokenizer.encode(sft_target(r)) + [tokenizer.eos_token_id], logprobs=[],
               weight_version=version, finish_reason="stop")
        for i, r in enumerate(rows)
    ]


@dataclass(frozen=True)
class SFTUpdate:
    """What one SFT-mode update did: the last epoch's loss, its grad norm and LR, the batch's tokens."""

    loss: float
    grad_norm: float
    lr: float
    tokens: int
    samples: int

    def metrics(self, rows: int, seconds: float, epochs: int, policy_version: int) -> dict[str, float]:
        """The step's metrics; a non-finite one is a FloatingPointError (the step diverged)."""
        metrics = {
            "loss": self.loss, "grad_norm": self.grad_norm, "lr": self.lr, "tokens": float(self.tokens),
            "tokens_per_s": self.tokens * epochs / max(seconds, 1e-9), "sft_rows": float(rows),
            "response_len_mean": self.tokens / self.samples, "step_seconds": seconds,
            "policy_version": float(policy_version),
        }
        for k, v in metrics.items():
            if v != v or v in (float("inf"), float("-inf")):
                raise FloatingPointError(f"sft_step: metric {k} is not finite ({v})")
        return metrics


def sft_update(policy: AdamWSteps, samples: list[Sample], hp: TrainSpec, pad_id: int) -> SFTUpdate:
    """``hp.ppo_epochs`` optimizer steps of ``policy`` on the samples' negative log-likelihood."""
    batches = micro_batches(samples, hp.micro_batch_size, pad_id)
    agg = Aggregation.over([b.tmask for b in batches], hp.loss_agg, hp.loss_agg_norm_len)
    policy.model.train()
    loss = grad_norm = lr = 0.0
    for _ in range(hp.ppo_epochs):
        lr = policy.start_optimizer_step(hp)
        loss = 0.0
        for b in batches:
            lp, _ = logprobs_and_logits(hf_model(policy), b.ids, b.mask, hp.precision)
            nll = agg.value(-lp, b.tmask)
            w = agg.weight(b.tmask)
            (nll * w).backward()
            loss += float(nll.detach()) * w
        grad_norm = policy.take_optimizer_step(hp, "sft_step")
    return SFTUpdate(loss, grad_norm, lr, agg.n_tokens, len(samples))


__all__ = ["SFTUpdate", "Warmup", "sft_samples", "sft_update", "warmup"]
