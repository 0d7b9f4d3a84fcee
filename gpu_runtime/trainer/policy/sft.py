"""SFT mode's update: one step of supervised fine-tuning on dataset rows.

Each row becomes a sample ``prompt -> sft_target(row) + EOS`` (the prompt encoded as the
engines see it); the loss is the negative log-likelihood of the target tokens only,
aggregated by ``train.loss_agg`` (token mean by default) over micro-batches of
``train.micro_batch_size``, with the run's AdamW, LR schedule and grad clip, and
``train.ppo_epochs`` optimizer steps per batch. The forward runs in ``train.precision``
(``gpu_runtime.models.precision``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gpu_runtime.algorithms.logprobs import logprobs_and_logits
from gpu_runtime.algorithms.losses import Aggregation
from gpu_runtime.data.datasets import encode_prompt, sft_target
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.api import TrainerHParams
from gpu_runtime.trainer.common.batches import micro_batches

if TYPE_CHECKING:
    from gpu_runtime.trainer.policy.trainer import PolicyTrainer


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


def sft_step(trainer: PolicyTrainer, rows: list[dict], hparams: TrainerHParams) -> dict[str, float]:
    t0 = time.perf_counter()
    trainer.hparams = hp = hparams
    samples = sft_samples(trainer.tokenizer, rows, trainer.policy_version)
    batches = micro_batches(samples, hp.micro_batch_size, trainer.tokenizer.pad_token_id)
    agg = Aggregation.over([b.tmask for b in batches], hp.loss_agg, hp.loss_agg_norm_len)
    trainer.model.train()
    loss = grad_norm = lr = 0.0
    for _ in range(hp.ppo_epochs):
        lr = trainer.start_optimizer_step(hp)
        loss = 0.0
        for b in batches:
            lp, _ = logprobs_and_logits(trainer.model, b.ids, b.mask, hp.precision)
            nll = agg.value(-lp, b.tmask)
            w = agg.weight(b.tmask)
            (nll * w).backward()
            loss += float(nll.detach()) * w
        grad_norm = trainer.take_optimizer_step(hp, "sft_step")
    trainer.policy_version += 1
    secs = time.perf_counter() - t0
    tokens = agg.n_tokens
    metrics = {
        "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": float(tokens),
        "tokens_per_s": tokens * hp.ppo_epochs / max(secs, 1e-9), "sft_rows": float(len(rows)),
        "response_len_mean": tokens / len(samples), "step_seconds": secs, "policy_version": float(trainer.policy_version),
    }
    for k, v in metrics.items():
        if v != v or v in (float("inf"), float("-inf")):
            raise FloatingPointError(f"sft_step: metric {k} is not finite ({v})")
    return metrics
