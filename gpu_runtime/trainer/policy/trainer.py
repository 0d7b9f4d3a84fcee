"""The GRPO policy trainer: model, frozen reference, AdamW, LR schedule, version.

Deterministic: given the same state and the same samples in the same order,
``train_step`` produces bitwise identical weights (CPU, fixed thread count).
``save_state``/``load_state`` capture everything needed to continue bitwise: the state is
composed of parts that save and load themselves (the trained weights and the reference:
``trained_state`` / ``reference_state``; AdamW and its schedule: ``common.optim``; the
critic: ``policy.critic``; RNGs and progress: ``common.state_io``).
Each step's ``train.precision`` says what the policy's (and the reference's / teacher's)
forward runs in: float32, or bf16 autocast over float32 master weights and AdamW states
with the loss math in float32 (``gpu_runtime.models.precision``); the PPO critic's value
model stays float32.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from pathlib import Path
from typing import Self

import torch
from transformers import PretrainedConfig, PreTrainedModel

from gpu_runtime.data.datasets import encode_prompt, final_answer
from gpu_runtime.data.rewards import extract_answer
from gpu_runtime.engine.generate import generate_batch
from gpu_runtime.models.causal_lm import export_state_dict, exported_tensors, load_causal_lm, load_exported_state_dict
from gpu_runtime.models.model_folder import save_model_folder, weights_checksum
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.store.artifacts import Sample, derive_seed
from gpu_runtime.trainer.common import lora as lora_lib
from gpu_runtime.trainer.common.batches import check_groups, step_metrics
from gpu_runtime.trainer.common.offload import OptimizerOffload
from gpu_runtime.trainer.common.optim import AdamWSteps
from gpu_runtime.trainer.common.snapshot import SnapshotBuffers, StateSnapshot
from gpu_runtime.trainer.policy import critic as critic_lib, distill as distill_lib, sft as sft_lib, state
from gpu_runtime.trainer.policy.state import REF_FILE, frozen_copy
from gpu_runtime.trainer.policy.step import micro_batch_backward, plan_step
from gpu_runtime.trainer.protocol import ALIVE, Health, StateWriter, TrainerDefaults
from spec.model import DistillSpec, LoraSpec
from spec.train import TrainSpec

log = logging.getLogger(__name__)


class PolicyTrainer(AdamWSteps, TrainerDefaults):
    model: PreTrainedModel
    health: Health = ALIVE  # in the trainer process itself: a failure ends the process (``protocol``)

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Tokenizer,
        hparams: TrainSpec,
        seed: int,
        ref_model: PreTrainedModel | None,
        lora: LoraSpec | None = None,
    ) -> None:
        self.model = model
        self.lora = lora  # set: ``model`` is peft-wrapped and only its adapters train
        self.distill: DistillSpec | None = None  # on-policy distillation from ``teacher``
        self.teacher: PreTrainedModel | None = None
        self.tokenizer = tokenizer
        self.hparams = hparams
        self.seed = seed
        self.ref_model = ref_model
        self.policy_version = 0
        self.optimizer = self.new_optimizer(hparams)
        self.opt_steps = 0  # LR-schedule position (optimizer steps taken in RL)
        self.critic: critic_lib.Critic | None = None  # estimator ppo: created at its first step (``policy.critic``)
        self.offload: OptimizerOffload | None = None  # engines.release_memory: AdamW parked between steps

    # ---------------------------------------------------------------- setup
    @classmethod
    def create(
        cls, base_folder: str | Path, hparams: TrainSpec, seed: int, lora: LoraSpec | None = None,
        distill: DistillSpec | None = None,
    ) -> Self:
        """A trainer over the model and tokenizer of a Hugging Face folder (the run's base model),
        with fresh LoRA adapters (seeded) when ``lora`` is given, and the frozen teacher of
        ``distill``."""
        tokenizer = Tokenizer.load(base_folder)
        model = load_causal_lm(base_folder)
        if model.config.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"{base_folder}: config vocab_size {model.config.vocab_size} < tokenizer's {tokenizer.vocab_size}")
        torch.manual_seed(derive_seed("trainer", seed) % (1 << 63))
        random.seed(derive_seed("trainer-py", seed))
        if lora is not None:
            model = lora_lib.apply_lora(model, lora, seed)
        model.train()
        ref = frozen_copy(model) if hparams.kl_coef > 0 else None
        trainer = cls(model, tokenizer, hparams, seed, ref, lora)
        if distill is not None:
            trainer.distill, trainer.teacher = distill, distill_lib.load_teacher(distill, tokenizer)
        return trainer

    # ----------------------------------------------------------------- SFT
    def sft_warmup(
        self, rows: list[dict], steps: int, batch_size: int, lr: float, seed: int, grad_clip: float | None = None,
        *, betas: tuple[float, float],
    ) -> dict[str, float]:
        """Supervised warm-up on ``prompt -> sft_target + EOS`` (loss on the target
        tokens only, token mean), AdamW with its own ``betas`` at a constant LR, batches
        drawn from ``seed``, the grad norm clipped only when ``grad_clip`` is given. Afterwards
        the RL optimizer/schedule are fresh, policy_version is 0 and the reference
        (if any) is a copy of the warmed-up weights."""
        first, last, secs = sft_lib.warmup(self, self.tokenizer, rows, sft_lib.Warmup(
            steps, batch_size, lr, seed, grad_clip, betas), self.hparams)
        self.optimizer = self.new_optimizer(self.hparams)
        self.opt_steps = 0
        self.policy_version = 0
        if self.ref_model is not None:
            self.ref_model = frozen_copy(self.model)
        log.info("sft warm-up: %d steps in %.1f s, loss %.3f -> %.3f", steps, secs, first, last)
        out = {"sft_steps": float(steps), "sft_seconds": secs, "sft_s_per_step": secs / max(steps, 1)}
        if steps:  # no losses to report when the warm-up is skipped (NaN would not survive JSON)
            out.update(sft_loss_first=first, sft_loss_last=last)
        return out

    def sft_step(self, rows: list[dict], hparams: TrainSpec) -> dict[str, float]:
        """One supervised update (SFT mode); increments ``policy_version`` by 1 (``policy.sft``)."""
        t0 = time.perf_counter()
        self.hparams = hparams
        samples = sft_lib.sft_samples(self.tokenizer, rows, self.policy_version)
        update = sft_lib.sft_update(self, samples, hparams, self.tokenizer.pad_token_id)
        self.policy_version += 1
        return update.metrics(len(rows), time.perf_counter() - t0, hparams.ppo_epochs, self.policy_version)

    # ------------------------------------------------------------------ RL
    def ensure_critic(self, hp: TrainSpec) -> critic_lib.Critic:
        """The PPO critic, created from the current policy weights at its first step."""
        if self.critic is None:
            self.critic = critic_lib.Critic(critic_lib.new_value_model(self.policy_config(), self.published_state(),
                                                                       self.seed), hp)
        return self.critic

    def _teacher(self) -> distill_lib.Teacher | None:
        if self.distill is None:
            return None
        assert self.teacher is not None
        return distill_lib.Teacher(self.teacher, self.distill.coef)

    def train_step(
        self, samples: list[Sample], rewards: list[float], group_size: int, hparams: TrainSpec,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """One RL update from one rollout; increments ``policy_version`` by 1.

        ``ppo_epochs`` optimizer steps over the whole batch, each accumulated over
        micro-batches whose shares add up to the batch's loss (``hparams.loss_agg``).
        The "old" logprobs are those of the current weights (taken, without grad,
        from the first epoch's forward, or from a forward of their own when the KL
        is part of the reward or the run distills), so the first epoch's ratio is 1.
        With ``distill`` the teacher's per-token term is added to the estimator's
        advantages (``policy.distill``). With estimator ``ppo`` the critic's old values
        give GAE advantages, and the critic trains alongside, one AdamW step per epoch
        (``policy.ppo``); during ``critic_warmup_steps`` only the critic steps. Every logprob,
        ratio, KL and entropy is of ``logits / temperature`` (``rollout.temperature``: the
        policy that sampled, ``algorithms.logprobs``)."""
        check_groups(samples, rewards, group_size)
        t0 = time.perf_counter()
        self.hparams = hp = hparams
        if hp.kl_coef > 0 and self.ref_model is None:
            raise ValueError("trainer.kl_coef > 0 needs a reference model: create the trainer with kl_coef > 0")
        critic = self.ensure_critic(hp) if hp.estimator == "ppo" else None
        plan = plan_step(self.model, self.ref_model, critic, self._teacher(), samples, rewards, group_size, hp,
                         self.tokenizer.pad_token_id, temperature)
        own = self.micro_batch_share(len(plan.batches))  # all of them, unless this is one rank of a cell
        self.model.train()
        sums = plan.first_sums(hp, own)
        grad_norm = 0.0
        lr = self.lr_at(self.opt_steps, hp)
        for epoch in range(hp.ppo_epochs):
            lr = self.start_optimizer_step(hp)
            if plan.critic is not None:
                plan.critic.critic.start_step(hp)
            last = epoch == hp.ppo_epochs - 1
            for k in own:
                micro_batch_backward(self.model, plan, k, hp, sums if last else None)
            if last:  # the metric sums are complete: reduced before the last update, so a DP cell
                # votes on both allreduces at once (``gpu_runtime.trainer.dp``)
                sums = self.reduce_over_cell(plan.local_sums(sums))
            if plan.trains_policy:
                grad_norm = self.take_optimizer_step(hp, "train_step")
            if plan.critic is not None:
                plan.critic.grad_norm = plan.critic.critic.take_step(hp)
        if plan.critic is not None:
            plan.critic.critic.steps += 1
        self.policy_version += 1
        return step_metrics(sums, samples, rewards, n_tokens=plan.agg.n_tokens, grad_norm=grad_norm, lr=lr,
                            seconds=time.perf_counter() - t0, policy_version=self.policy_version,
                            epochs=hp.ppo_epochs, extra=plan.extra_metrics(hp))

    # ------------------------------------------ a cell's rank overrides these
    def micro_batch_share(self, n: int) -> list[int]:
        """The indices of the step's ``n`` micro-batches this process trains on: all of them
        (a rank of a sharded cell takes its share, ``gpu_runtime.trainer.fsdp2.rank``)."""
        return list(range(n))

    def reduce_over_cell(self, sums: dict[str, float]) -> dict[str, float]:
        """Metric sums over the processes that trained the step: this one only."""
        return sums

    # --------------------------------------------------------------- weights
    def policy_config(self) -> PretrainedConfig:
        """The policy's architecture (the base model's under LoRA)."""
        return (lora_lib.base_model(self.model) if self.lora else self.model).config

    def published_state(self) -> dict[str, torch.Tensor]:
        """The weights engines load for this version (merged with the adapters under LoRA)."""
        return lora_lib.merged_state_dict(self.model) if self.lora else export_state_dict(self.model)

    def checksum(self) -> str:
        return weights_checksum(self.published_state() if self.lora else exported_tensors(self.model))

    def broadcast_tensors(self, exported: Path) -> dict[str, torch.Tensor]:
        """The full-tuned model's own tensors as views (no second copy of the weights on the
        trainer's device), or LoRA's merged weights."""
        return self.published_state() if self.lora else exported_tensors(self.model)

    def export_model_folder(self, folder: str | Path) -> str:
        """This version as a plain model folder (merged weights under LoRA)."""
        plain = lora_lib.base_model(self.model) if self.lora else self.model
        return save_model_folder(plain, self.tokenizer, folder, weight_version=self.policy_version,
                                 weights=self.published_state() if self.lora else None)

    def export_adapter_folder(self, folder: str | Path, base_model: str) -> None:
        """The adapters as a peft adapter folder over ``base_model`` (LoRA only)."""
        if not self.lora:
            raise ValueError("export_adapter_folder: the trainer has no LoRA adapters")
        lora_lib.save_adapter_folder(self.model, folder, base_model)

    # ------------------------------------------- state: the parts, each its own
    def _model_state(self, model: PreTrainedModel) -> dict[str, torch.Tensor]:
        return lora_lib.adapter_state_dict(model) if self.lora else export_state_dict(model)

    def _load_model_state(self, model: PreTrainedModel, sd: dict[str, torch.Tensor]) -> None:
        if self.lora:
            lora_lib.load_adapter_state_dict(model, sd)
        else:
            load_exported_state_dict(model, sd)

    def trained_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds of the policy: every weight, or the adapters only under LoRA."""
        return self._model_state(self.model)

    def reference_state(self) -> dict[str, torch.Tensor] | None:
        """The KL reference's, the same way (None: the trainer keeps none)."""
        return None if self.ref_model is None else self._model_state(self.ref_model)

    def load_trained_state(self, sd: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self._load_model_state(self.model, sd)

    def load_reference_state(self, sd: dict[str, torch.Tensor] | None) -> None:
        """The reference ``reference_state`` returned (made from the policy first when the
        trainer has none); None drops the trainer's reference."""
        if sd is None:
            self.ref_model = None
            return
        if self.ref_model is None:
            self.ref_model = frozen_copy(self.model)
        with torch.no_grad():
            self._load_model_state(self.ref_model, sd)

    def save_state(self, folder: str | Path) -> None:
        """Write the full trainer state into ``folder`` (meta file last): the trained weights
        (and the reference's, ``REF_FILE``), the architecture and tokenizer, AdamW, the critic
        (``critic.safetensors``, ``critic_optimizer.safetensors``: never published), torch's RNG."""
        self.state_snapshot().write(Path(folder))

    def state_snapshot(self, buffers: SnapshotBuffers | None = None, checksum: str | None = None) -> StateSnapshot:
        """What ``save_state`` writes, taken now. With ``buffers`` every tensor is copied into
        them (the snapshot stays valid while the trainer trains on); without, the snapshot
        holds the live tensors and must be written before the next step. ``checksum``: this
        version's published-weights checksum when the caller knows it (else computed)."""
        return state.state_snapshot(self, buffers, checksum)

    def live_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict]]:
        """The tensor files of ``save_state`` that a snapshot copies, as live views (the trained
        weights, the reference's, AdamW's state), and AdamW's param groups."""
        return state.live_state(self)

    @classmethod
    def from_state(cls, folder: str | Path) -> Self:
        """Build a trainer from a folder written by ``save_state`` (full fine-tuning only)."""
        model, ref, meta = state.model_from_state(folder)
        trainer = cls(model, Tokenizer.load(folder), TrainSpec.model_validate(meta["hparams"]), int(meta["seed"]), ref)
        trainer.load_state(folder)
        return trainer

    def load_state(self, folder: str | Path) -> None:
        """Restore weights, reference, optimizer, schedule, critic, RNG and version from ``folder``."""
        state.load_state(self, folder)

    # ------------------------------------- what the trainer process asks (``protocol``)
    def state_writer(self, buffers: SnapshotBuffers, checksum: str | None, scratch: Path) -> StateWriter:
        """A checkpoint's state: a snapshot copied into ``buffers`` now (the step waits only for
        the copy), its files written by the upload thread."""
        return self.state_snapshot(buffers, checksum).write

    def warm_snapshot(self, buffers: SnapshotBuffers) -> threading.Thread | None:
        return buffers.warm(buffers.missing(self.live_state()[0]))

    def release_optimizer(self) -> None:
        """AdamW's (and the critic's) state to the host, the grads freed (``common.offload``)."""
        if self.offload is None:  # its host buffers, reused by every later offload
            self.offload = OptimizerOffload()
        opts = [self.optimizer] + ([self.critic.optimizer] if self.critic is not None else [])
        moved = self.offload.offload(opts)
        log.info("optimizer state offloaded: %.1f MB in %.1f ms", moved / 1e6, self.offload.last_offload_s * 1e3)

    def reclaim_optimizer(self) -> None:
        if self.offload is not None:
            self.offload.onload()

    # ---------------------------------------------------------------- eval
    def evaluate_greedy(self, rows: list[dict], limit: int = 200, max_new_tokens: int = 8, batch_size: int = 128) -> float:
        """Greedy accuracy (math answer check) on the first ``limit`` rows."""
        rows = rows[:limit]
        if not rows:
            raise ValueError("evaluate_greedy: rows must not be empty")
        correct = 0
        for i in range(0, len(rows), batch_size):
            chunk = rows[i : i + batch_size]
            outs = generate_batch(
                self.model, [encode_prompt(self.tokenizer, r) for r in chunk], max_new_tokens=max_new_tokens,
                temperature=0.0, eos_id=self.tokenizer.eos_token_id, pad_id=self.tokenizer.pad_token_id,
            )
            correct += sum(extract_answer(self.tokenizer.decode(o.output_ids)) == final_answer(r) for o, r in zip(outs, chunk))
        self.model.train()
        return correct / len(rows)


__all__ = ["PolicyTrainer", "REF_FILE", "frozen_copy"]
