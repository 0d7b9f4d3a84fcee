"""The GRPO policy trainer: model, frozen reference, AdamW, LR schedule, version.

Deterministic: given the same state and the same samples in the same order,
``train_step`` produces bitwise identical weights (CPU, fixed thread count).
``save_state``/``load_state`` capture everything needed to continue bitwise.
Each step's ``train.precision`` says what the policy's (and the reference's / teacher's)
forward runs in: float32, or bf16 autocast over float32 master weights and AdamW states
with the loss math in float32 (``gpu_runtime.models.precision``); the PPO critic's value
model stays float32.
"""

from __future__ import annotations

import copy
import logging
import random
import time
from pathlib import Path

import torch

from gpu_runtime.store.artifacts import Sample, derive_seed
from gpu_runtime.data.datasets import encode_prompt, final_answer, sft_target
from gpu_runtime.engine.generate import generate_batch
from gpu_runtime.algorithms.logprobs import logprobs_and_logits
from gpu_runtime.algorithms.losses import (
    Aggregation,
    entropy_from_logits,
    kl_per_token,
    masked_mean,
    policy_loss_per_token,
    tis_weights,
)
from gpu_runtime.trainer.common.batches import (
    check_groups,
    logprob_gap_sums,
    micro_batch_advantages,
    micro_batches,
    pad_batch,
    response_mask,
    step_metrics,
)
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from gpu_runtime.models.causal_lm import (
    ATTENTION,
    export_state_dict,
    load_causal_lm,
    load_exported_state_dict,
)
from gpu_runtime.models.model_folder import save_model_folder, weights_checksum
from gpu_runtime.data.rewards import extract_answer
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.trainer.policy import critic as critic_lib
from gpu_runtime.trainer.policy import distill as distill_lib
from gpu_runtime.trainer.common import lora as lora_lib
from gpu_runtime.trainer.policy import sft as sft_lib
from gpu_runtime.trainer.policy import state as trainer_state
from gpu_runtime.trainer.api import DistillSettings, LoraSettings, TrainerHParams, stored_hparams
from gpu_runtime.trainer.common.optim import AdamWSteps
from gpu_runtime.trainer.policy.ppo import CriticPass

log = logging.getLogger(__name__)



class PolicyTrainer(AdamWSteps):
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Tokenizer,
        hparams: TrainerHParams,
        seed: int,
        ref_model: PreTrainedModel | None,
        lora: LoraSettings | None = None,
    ) -> None:
        self.model = model
        self.lora = lora  # set: ``model`` is peft-wrapped and only its adapters train
        self.distill: DistillSettings | None = None  # on-policy distillation from ``teacher``
        self.teacher: PreTrainedModel | None = None
        self.tokenizer = tokenizer
        self.hparams = hparams
        self.seed = seed
        self.ref_model = ref_model
        self.policy_version = 0
        self.optimizer = self._new_optimizer(hparams)
        self.opt_steps = 0  # LR-schedule position (optimizer steps taken in RL)
        self.critic: critic_lib.Critic | None = None  # estimator ppo: created at its first step (``policy.critic``)

    # ---------------------------------------------------------------- setup
    @classmethod
    def create(
        cls, base_folder: str | Path, hparams: TrainerHParams, seed: int, lora: LoraSettings | None = None,
        distill: DistillSettings | None = None,
    ) -> "PolicyTrainer":
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
        ref = cls._frozen_copy(model) if hparams.kl_coef > 0 else None
        trainer = cls(model, tokenizer, hparams, seed, ref, lora)
        if distill is not None:
            trainer.distill, trainer.teacher = distill, distill_lib.load_teacher(distill, tokenizer)
        return trainer

    @staticmethod
    def _frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
        ref = copy.deepcopy(model)
        ref.eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

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
        if not rows:
            raise ValueError("sft rows must not be empty")
        if steps < 0 or batch_size <= 0:
            raise ValueError(f"sft steps must be >= 0 and sft batch_size > 0, got {steps}, {batch_size}")
        encoded = [
            (encode_prompt(self.tokenizer, r), self.tokenizer.encode(sft_target(r)) + [self.tokenizer.eos_token_id])
            for r in rows
        ]
        opt = self._new_optimizer(self.hparams.model_copy(update={"betas": betas}), lr=lr)
        self.model.train()
        t0 = time.perf_counter()
        first = last = float("nan")
        for step in range(steps):
            rng = random.Random(derive_seed("sft", seed, step))
            batch = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
            ids, mask = pad_batch([p + c for p, c in batch], self.tokenizer.pad_token_id)
            tmask = response_mask([len(p) for p, _ in batch], [len(p) + len(c) for p, c in batch], ids.shape[1] - 1)
            lp, _ = logprobs_and_logits(self.model, ids, mask, self.hparams.precision)
            loss = -masked_mean(lp, tmask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(lora_lib.trainable_parameters(self.model), grad_clip)
            opt.step()
            last = float(loss.detach())
            if step == 0:
                first = last
        secs = time.perf_counter() - t0
        self.optimizer = self._new_optimizer(self.hparams)
        self.opt_steps = 0
        self.policy_version = 0
        if self.ref_model is not None:
            self.ref_model = self._frozen_copy(self.model)
        log.info("sft warm-up: %d steps in %.1f s, loss %.3f -> %.3f", steps, secs, first, last)
        out = {"sft_steps": float(steps), "sft_seconds": secs, "sft_s_per_step": secs / max(steps, 1)}
        if steps:  # no losses to report when the warm-up is skipped (NaN would not survive JSON)
            out.update(sft_loss_first=first, sft_loss_last=last)
        return out

    # ------------------------------------------------------- optimizer steps
    # (``AdamWSteps``: _new_optimizer, lr_at, start_optimizer_step, take_optimizer_step)
    def sft_step(self, rows: list[dict], hparams: TrainerHParams) -> dict[str, float]:
        """One supervised update (SFT mode); increments ``policy_version`` by 1 (``policy.sft``)."""
        return sft_lib.sft_step(self, rows, hparams)

    # ------------------------------------------------------------------ RL
    def _ensure_critic(self, hp: TrainerHParams) -> critic_lib.Critic:
        """The PPO critic, created from the current policy weights at its first step."""
        if self.critic is None:
            config = (self.model.get_base_model() if self.lora else self.model).config
            self.critic = critic_lib.Critic(critic_lib.new_value_model(config, self.published_state(), self.seed), hp)
        return self.critic

    def _check_groups(self, samples: list[Sample], rewards: list[float], group_size: int) -> None:
        check_groups(samples, rewards, group_size)

    def train_step(
        self, samples: list[Sample], rewards: list[float], group_size: int, hparams: TrainerHParams
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
        (``policy.ppo``); during ``critic_warmup_steps`` only the critic steps."""
        self._check_groups(samples, rewards, group_size)
        t0 = time.perf_counter()
        self.hparams = hp = hparams
        if hp.kl_coef > 0 and self.ref_model is None:
            raise ValueError("trainer.kl_coef > 0 needs a reference model: create the trainer with kl_coef > 0")
        r = torch.tensor(rewards, dtype=torch.float32)
        batches = micro_batches(samples, hp.micro_batch_size, self.tokenizer.pad_token_id)
        agg = Aggregation.over([b.tmask for b in batches], hp.loss_agg, hp.loss_agg_norm_len)
        n_tokens = agg.n_tokens
        ref_lps: list[torch.Tensor | None] = [None] * len(batches)
        if hp.kl_coef > 0:
            assert self.ref_model is not None
            with torch.no_grad():
                ref_lps = [logprobs_and_logits(self.ref_model, b.ids, b.mask, hp.precision)[0] for b in batches]
        old_lps: list[torch.Tensor | None] = [None] * len(batches)  # filled by the first epoch's forwards
        reward_kl: list[torch.Tensor] | None = None  # the KL penalty of the reward, per micro-batch
        kl_in_reward = hp.kl_in_reward and hp.kl_coef > 0
        if kl_in_reward or self.distill is not None:  # advantages that need the old logprobs first
            with torch.no_grad():
                old_lps = [logprobs_and_logits(self.model, b.ids, b.mask, hp.precision)[0] for b in batches]
        if kl_in_reward:
            reward_kl = [kl_per_token(old, ref, hp.kl_estimator) for old, ref in zip(old_lps, ref_lps) if ref is not None]
        critic: CriticPass | None = None
        if hp.estimator == "ppo":
            critic = CriticPass.start(self._ensure_critic(hp), batches, r, hp, reward_kl)
            advs = critic.advantages
        else:
            advs = micro_batch_advantages(batches, r, group_size, hp, reward_kl)
        train_policy = critic is None or critic.trains_policy
        distill_kl: float | None = None
        if self.distill is not None:
            assert self.teacher is not None
            terms, distill_kl = distill_lib.distill_terms(self.teacher, batches, old_lps, self.distill.coef,  # type: ignore[arg-type]
                                                           hp.precision)
            advs = [a + t for a, t in zip(advs, terms)]
        tis: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by micro-batch (a cell's rank has a share of them)
        own = self.micro_batch_share(len(batches))  # all of them, unless this is one rank of a cell
        self.model.train()
        sums = {"loss": 0.0, "pg_loss": 0.0, "kl": 0.0, "entropy": 0.0, "clip_fraction": 0.0}
        if hp.dual_clip_c is not None:
            sums["dual_clip_fraction"] = 0.0
        if reward_kl is not None:
            sums["kl"] = sum(float(agg(reward_kl[k], batches[k].tmask)) for k in own)  # a cell adds its ranks' shares
        grad_norm = 0.0
        lr = self.lr_at(self.opt_steps, hp)
        for epoch in range(hp.ppo_epochs):
            lr = self.start_optimizer_step(hp)
            if critic is not None:
                critic.critic.start_step(hp)
            last = epoch == hp.ppo_epochs - 1
            for k in own:
                b = batches[k]
                tmask = b.tmask
                lp, logits = logprobs_and_logits(self.model, b.ids, b.mask, hp.precision)
                if old_lps[k] is None:
                    old_lps[k] = lp.detach()
                old = old_lps[k]
                assert old is not None
                if hp.tis_cap is not None and k not in tis:
                    tis[k] = tis_weights(old, b.engine_logprobs(), hp.tis_cap)
                terms = policy_loss_per_token(hp.estimator, lp, old, advs[k], tmask, clip_eps=hp.clip_eps,
                                              clip_eps_high=hp.clip_eps_high, dual_clip_c=hp.dual_clip_c)
                per_token = terms.loss * tis[k][0] if tis else terms.loss
                pg = agg.value(per_token, tmask)
                loss = pg
                kl = torch.zeros(())
                ref = ref_lps[k]
                if ref is not None and reward_kl is None:
                    kl = agg.value(kl_per_token(lp, ref, hp.kl_estimator), tmask)
                    loss = loss + hp.kl_coef * kl
                ent: torch.Tensor | None = None
                if hp.entropy_coef > 0:
                    ent = agg.value(entropy_from_logits(logits), tmask)
                    loss = loss - hp.entropy_coef * ent
                w = agg.weight(tmask)
                if train_policy:
                    (loss * w).backward()
                if critic is not None:
                    critic.backward(k, b, agg, hp, record=last)
                if last:
                    if ent is None:
                        with torch.no_grad():
                            ent = agg.value(entropy_from_logits(logits.detach()), tmask)
                    share = float(tmask.sum()) / max(n_tokens, 1)  # fractions are token shares
                    values = [("loss", loss, w), ("pg_loss", pg, w), ("entropy", ent, w),
                              ("clip_fraction", masked_mean(terms.clipped.to(lp.dtype), tmask), share)]
                    if reward_kl is None:
                        values.append(("kl", kl, w))
                    if terms.dual_clipped is not None:
                        values.append(("dual_clip_fraction", masked_mean(terms.dual_clipped.to(lp.dtype), tmask), share))
                    for name, v, weight in values:
                        sums[name] += float(v.detach()) * weight
            if last:  # the metric sums are complete: reduced before the last update, so a DP cell
                # votes on both allreduces at once (``gpu_runtime.trainer.dp``)
                sums = self._step_sums(sums, batches, old_lps, tis, n_tokens)
            if train_policy:
                grad_norm = self.take_optimizer_step(hp, "train_step")
            if critic is not None:
                critic.grad_norm = critic.critic.take_step(hp)
        if critic is not None:
            critic.critic.steps += 1
        self.policy_version += 1
        extra = critic.metrics(hp, n_tokens) if critic is not None else {}
        if distill_kl is not None:
            extra["distill_kl"] = distill_kl
        return step_metrics(sums, samples, rewards, n_tokens=n_tokens, grad_norm=grad_norm, lr=lr,
                            seconds=time.perf_counter() - t0, policy_version=self.policy_version,
                            epochs=hp.ppo_epochs, extra=extra)

    def _step_sums(self, sums: dict[str, float], batches: list, old_lps: list, tis: dict,
                   n_tokens: int) -> dict[str, float]:
        """The step's metric sums over every process that trained it: this process's loss
        sums plus the rollout-logprob gap and the TIS weights of its micro-batches."""
        gap_total, gap_count = logprob_gap_sums(batches, old_lps)
        if tis:  # token-share weighted over this process's micro-batches (a cell adds its ranks' sums)
            shares = {k: float(batches[k].tmask.sum()) / max(n_tokens, 1) for k in tis}
            sums["tis_weight_mean"] = sum(float(masked_mean(wt, batches[k].tmask)) * shares[k] for k, (wt, _) in tis.items())
            sums["tis_clip_fraction"] = sum(
                float(masked_mean(c.to(torch.float32), batches[k].tmask)) * shares[k] for k, (_, c) in tis.items())
        return self.reduce_over_cell({**sums, "gap_total": gap_total, "gap_count": gap_count})

    # ------------------------------------------ a cell's rank overrides these
    def micro_batch_share(self, n: int) -> list[int]:
        """The indices of the step's ``n`` micro-batches this process trains on: all of them
        (a rank of a sharded cell takes its share, ``gpu_runtime.trainer.fsdp2.rank``)."""
        return list(range(n))

    def reduce_over_cell(self, sums: dict[str, float]) -> dict[str, float]:
        """Metric sums over the processes that trained the step: this one only."""
        return sums

    # --------------------------------------------------------------- state
    def published_state(self) -> dict[str, torch.Tensor]:
        """The weights engines load for this version (merged with the adapters under LoRA)."""
        return lora_lib.merged_state_dict(self.model) if self.lora else export_state_dict(self.model)

    def _trained_state(self, model: PreTrainedModel) -> dict[str, torch.Tensor]:
        """What a checkpoint holds of ``model``: every weight, or the adapters only under LoRA."""
        return lora_lib.adapter_state_dict(model) if self.lora else export_state_dict(model)

    def _load_trained_state(self, model: PreTrainedModel, sd: dict[str, torch.Tensor]) -> None:
        if self.lora:
            lora_lib.load_adapter_state_dict(model, sd)
        else:
            load_exported_state_dict(model, sd)

    def checksum(self) -> str:
        return weights_checksum(self.published_state())

    def export_model_folder(self, folder: str | Path) -> str:
        """This version as a plain model folder (merged weights under LoRA)."""
        plain = self.model.get_base_model() if self.lora else self.model
        return save_model_folder(plain, self.tokenizer, folder, weight_version=self.policy_version,
                                 weights=self.published_state() if self.lora else None)

    def export_adapter_folder(self, folder: str | Path, base_model: str) -> None:
        """The adapters as a peft adapter folder over ``base_model`` (LoRA only)."""
        if not self.lora:
            raise ValueError("export_adapter_folder: the trainer has no LoRA adapters")
        lora_lib.save_adapter_folder(self.model, folder, base_model)

    def save_state(self, folder: str | Path) -> None:
        """Write the full trainer state into ``folder`` (meta file last)."""
        trainer_state.save(self, folder)

    @classmethod
    def from_state(cls, folder: str | Path) -> "PolicyTrainer":
        """Build a trainer from a folder written by ``save_state`` (full fine-tuning only)."""
        meta = trainer_state.read_meta(Path(folder))
        if meta.get("lora"):
            raise ValueError(f"{folder}: a LoRA checkpoint holds adapters only: build the trainer from its base model")
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=ATTENTION)
        ref = cls._frozen_copy(model) if meta["has_reference"] else None
        trainer = cls(model, Tokenizer.load(folder), stored_hparams(meta["hparams"]), int(meta["seed"]), ref)
        trainer.load_state(folder)
        return trainer

    def load_state(self, folder: str | Path) -> None:
        """Restore weights, reference, optimizer, schedule, RNG and version from ``folder``."""
        trainer_state.load(self, folder)

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


__all__ = ["PolicyTrainer", "pad_batch", "response_mask"]
