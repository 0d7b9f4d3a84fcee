"""Samples as padded training tensors, and the two token layouts the trainer uses.

A micro-batch is right-padded ``prompt + response`` ids; its per-token tensors are
``[B, T-1]`` over next-token targets (``tmask`` marks the response tokens the loss
counts: all of them, except an agent episode's tool-turn tokens, ``Sample.loss_mask``). The
advantage estimators work **response-aligned** instead: ``[N, L]`` with column
``t`` the ``t``-th response token of a sample, the same for every micro-batch
split. ``MicroBatch`` converts between the two.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu_runtime.algorithms.advantages import compute_advantages
from gpu_runtime.store.artifacts import Sample
from spec.train import TrainSpec


def pad_batch(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token lists -> (input_ids [B, T] int64, attention_mask [B, T] bool)."""
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), t), dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = True
    return ids, mask


def response_mask(prompt_lens: list[int], total_lens: list[int], width: int) -> torch.Tensor:
    """[B, width] bool over next-token targets: target j (token j+1) is a response token."""
    j = torch.arange(width)[None, :] + 1
    p = torch.tensor(prompt_lens)[:, None]
    n = torch.tensor(total_lens)[:, None]
    return (j >= p) & (j < n)


def response_aligned_mask(samples: list[Sample]) -> torch.Tensor:
    """[N, L] bool, L the longest response: ``mask[i, :len(response_i)]`` is true, except on
    the tokens an agent episode's ``loss_mask`` excludes (its tool turns)."""
    lens = torch.tensor([len(s.response_ids) for s in samples])
    mask = torch.arange(int(lens.max()))[None, :] < lens[:, None]
    for i, s in enumerate(samples):
        if s.loss_mask is not None:
            mask[i, : len(s.loss_mask)] &= torch.tensor(s.loss_mask, dtype=torch.bool)
    return mask


def _check_loss_mask(s: Sample) -> None:
    if s.loss_mask is not None and len(s.loss_mask) != len(s.response_ids):
        raise ValueError(f"sample {s.sample_id}: loss_mask has {len(s.loss_mask)} entries for "
                         f"{len(s.response_ids)} response tokens")


@dataclass(frozen=True)
class MicroBatch:
    samples: list[Sample]
    ids: torch.Tensor  # [B, T] int64
    mask: torch.Tensor  # [B, T] bool attention mask
    tmask: torch.Tensor  # [B, T-1] bool: the target is a response token

    @classmethod
    def of(cls, samples: list[Sample], pad_id: int) -> MicroBatch:
        ids, mask = pad_batch([s.prompt_ids + s.response_ids for s in samples], pad_id)
        tmask = response_mask([len(s.prompt_ids) for s in samples],
                              [len(s.prompt_ids) + len(s.response_ids) for s in samples], ids.shape[1] - 1)
        for b, s in enumerate(samples):  # an agent episode's tool-turn tokens are never trained
            _check_loss_mask(s)
            if s.loss_mask is not None:
                start = len(s.prompt_ids) - 1
                tmask[b, start : start + len(s.loss_mask)] &= torch.tensor(s.loss_mask, dtype=torch.bool)
        return cls(samples, ids, mask, tmask)

    def _spans(self) -> list[tuple[int, int]]:
        """(first target position, response length) per sample."""
        return [(len(s.prompt_ids) - 1, len(s.response_ids)) for s in self.samples]

    def from_response(self, x: torch.Tensor) -> torch.Tensor:
        """Response-aligned ``x [B, L]`` in this micro-batch's layout ``[B, T-1]`` (0 off the response)."""
        out = torch.zeros(self.tmask.shape, dtype=x.dtype)
        for b, (start, n) in enumerate(self._spans()):
            out[b, start : start + n] = x[b, :n]
        return out

    def to_response(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """``x [B, T-1]`` in this layout as response-aligned ``[B, width]`` (0 past each response)."""
        out = torch.zeros((len(self.samples), width), dtype=x.dtype)
        for b, (start, n) in enumerate(self._spans()):
            out[b, :n] = x[b, start : start + n]
        return out

    def engine_logprobs(self) -> torch.Tensor:
        """The engine's logprobs of the response tokens in this layout (needs one per token)."""
        for s in self.samples:
            if len(s.logprobs) != len(s.response_ids):
                raise ValueError(
                    f"sample {s.sample_id}: tis_cap needs the engine's logprob of every response token, "
                    f"got {len(s.logprobs)} for {len(s.response_ids)} tokens"
                )
        width = max(len(s.response_ids) for s in self.samples)
        aligned = torch.zeros((len(self.samples), width), dtype=torch.float32)
        for b, s in enumerate(self.samples):
            aligned[b, : len(s.logprobs)] = torch.tensor(s.logprobs, dtype=torch.float32)
        return self.from_response(aligned)


def check_groups(samples: list[Sample], rewards: list[float], group_size: int) -> None:
    """A train step's input: one reward per sample, contiguous groups of ``group_size``
    samples sharing one prompt, every sample with a prompt and a response."""
    if not samples:
        raise ValueError("samples must not be empty")
    if len(rewards) != len(samples):
        raise ValueError(f"rewards has {len(rewards)} entries for {len(samples)} samples")
    if group_size <= 0 or len(samples) % group_size:
        raise ValueError(f"group_size={group_size} must divide the number of samples ({len(samples)})")
    for g in range(0, len(samples), group_size):
        grp = samples[g : g + group_size]
        if any(s.prompt_index != grp[0].prompt_index or s.prompt_ids != grp[0].prompt_ids for s in grp):
            raise ValueError(f"samples {g}..{g + group_size - 1}: a group must share one prompt (contiguous groups)")
    for s in samples:
        if not s.prompt_ids or not s.response_ids:
            raise ValueError(f"sample {s.sample_id}: prompt_ids and response_ids must be non-empty")


def step_metrics(sums: dict[str, float], samples: list[Sample], rewards: list[float], *, n_tokens: float,
                 grad_norm: float, lr: float, seconds: float, policy_version: int, epochs: int = 1,
                 extra: dict[str, float] | None = None) -> dict[str, float]:
    """A train step's metrics as every trainer backend reports them: its loss sums (the
    train-inference logprob gap's ``gap_total`` / ``gap_count`` / ``gap_max`` among them, turned
    into ``rollout_logprob_abs_diff`` (the mean) and ``rollout_logprob_abs_diff_max``), ``extra``
    (critic, distillation), then the step's own.
    A non-finite one is a FloatingPointError (the step diverged)."""
    metrics = dict(sums)
    gap_total, gap_count, gap_max = metrics.pop("gap_total"), metrics.pop("gap_count"), metrics.pop("gap_max")
    metrics.update(extra or {})
    r = torch.tensor(rewards, dtype=torch.float32)
    lens = [float(len(s.response_ids)) for s in samples]
    metrics.update(
        grad_norm=grad_norm, lr=lr, tokens=float(n_tokens), tokens_per_s=n_tokens * epochs / max(seconds, 1e-9),
        reward_mean=float(r.mean()), reward_std=float(r.std(unbiased=False)), response_len_mean=sum(lens) / len(lens),
        step_seconds=seconds, policy_version=float(policy_version),
        rollout_logprob_abs_diff=gap_total / gap_count if gap_count else 0.0, rollout_logprob_abs_diff_max=gap_max,
    )
    for k, v in metrics.items():
        if v != v or v in (float("inf"), float("-inf")):
            raise FloatingPointError(f"train_step: metric {k} is not finite ({v})")
    return metrics


def lr_at(step: int, hp: TrainSpec) -> float:
    """The RL LR schedule: constant with optional linear warm-up over ``warmup_steps`` optimizer steps."""
    if hp.warmup_steps > 0 and step < hp.warmup_steps:
        return hp.lr * (step + 1) / hp.warmup_steps
    return hp.lr


def micro_batches(samples: list[Sample], size: int, pad_id: int) -> list[MicroBatch]:
    return [MicroBatch.of(samples[i : i + size], pad_id) for i in range(0, len(samples), size)]


def micro_batch_advantages(
    batches: list[MicroBatch], rewards: torch.Tensor, group_size: int, hp: TrainSpec,
    reward_kl: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """``hp.estimator``'s advantages for the whole batch, per micro-batch in its
    ``[B, T-1]`` layout. ``reward_kl``: the per-token KL of each micro-batch when
    the KL is part of the reward."""
    samples = [s for b in batches for s in b.samples]
    rmask = response_aligned_mask(samples)
    width = rmask.shape[1]
    token_kl = None if reward_kl is None else torch.cat([b.to_response(kl, width) for b, kl in zip(batches, reward_kl)])
    adv = compute_advantages(hp.estimator, rewards, group_size, rmask, scale_by_std=hp.scale_adv_by_std,
                             token_kl=token_kl, kl_coef=hp.kl_coef)
    out, i = [], 0
    for b in batches:
        out.append(b.from_response(adv[i : i + len(b.samples)]))
        i += len(b.samples)
    return out


def logprob_gap_sums(batches: list[MicroBatch], old_lps: list[torch.Tensor | None]) -> dict[str, float]:
    """The train-inference logprob gap of the step's response tokens, as sums a cell can add
    up: ``gap_total`` (of |engine logprob - trainer old logprob|), ``gap_count`` (tokens) and
    ``gap_max`` (a maximum: ``cell_reduced`` takes it over the ranks), skipping micro-batches
    without trainer logprobs (those another rank of a cell trained) and samples without the
    engine's logprob of every token."""
    total, count, top = 0.0, 0, 0.0
    for k, batch in enumerate(batches):
        mine_k = old_lps[k]
        if mine_k is None:
            continue
        for b, s in enumerate(batch.samples):
            if len(s.logprobs) != len(s.response_ids):
                continue
            mine = mine_k[b][batch.tmask[b]]
            engine = torch.tensor(s.logprobs, dtype=mine.dtype)
            if s.loss_mask is not None:  # tool-turn tokens have no engine logprob
                engine = engine[torch.tensor(s.loss_mask, dtype=torch.bool)]
            gap = (mine - engine).abs()
            total += float(gap.sum())
            count += len(engine)
            if len(engine):
                top = max(top, float(gap.max()))
    return {"gap_total": total, "gap_count": float(count), "gap_max": top}


MAX_SUMS = ("gap_max",)  # metric "sums" that are maxima: a cell takes the largest of its ranks'


def cell_reduced(sums: dict[str, float], slot: int, slots: int,
                 allreduce_sum: Callable[[torch.Tensor], object]) -> dict[str, float]:
    """The step's metric sums over the processes of a cell, in one allreduce (SUM) of float64:
    the sums add up; each of ``MAX_SUMS`` travels in this process's own ``slot`` of ``slots``
    (zeros elsewhere), so the sum holds every process's value and the largest is taken."""
    names = sorted(k for k in sums if k not in MAX_SUMS)
    maxima = sorted(k for k in sums if k in MAX_SUMS)
    values = [sums[k] for k in names]
    for k in maxima:
        values += [sums[k] if i == slot else 0.0 for i in range(slots)]
    t = torch.tensor(values, dtype=torch.float64)
    allreduce_sum(t)
    flat = t.tolist()
    out = dict(zip(names, flat[: len(names)]))
    for j, k in enumerate(maxima):
        start = len(names) + j * slots
        out[k] = max(flat[start : start + slots])
    return out
