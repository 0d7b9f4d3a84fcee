"""PPO's critic: a separate value model, its AdamW and its step count.

Why a separate model and not a value head on the policy's trunk: a shared trunk puts
the value loss's gradient into the policy's weights (the published model would then
depend on ``vf_coef``), and LoRA, checkpoints and the HF export would all have to tell
the policy's tensors from the critic's. A separate critic (verl, OpenRLHF) keeps the
policy update exactly the other estimators' one, has its own learning rate and
optimizer, and is never published: engines and the HF export only ever see the policy.
For the tiny models this project trains the second copy costs little; on big models it
is what verl and OpenRLHF pay too.

The critic is the policy's transformer trunk (its decoder, without the LM head) and a
linear value head on the last hidden state. It is created at the first ``ppo`` step
from the policy's weights at that moment (post-SFT, merged under LoRA; full fine-tuning
of the critic either way) and a head drawn from the run seed, so a trainer rebuilt by
checkpoint + replay creates it bitwise the same. From then on a checkpoint holds it.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, PretrainedConfig

from gpu_runtime.models.causal_lm import ATTENTION, load_exported_state_dict, positions_from_mask
from gpu_runtime.models.model_folder import weights_checksum
from gpu_runtime.store.artifacts import derive_seed
from gpu_runtime.trainer.common.state_io import load_optimizer_tensors, optimizer_tensors
from spec.train import TrainSpec

CRITIC_WEIGHTS = "critic.safetensors"
CRITIC_OPTIM = "critic_optimizer.safetensors"


class ValueModel(torch.nn.Module):
    """trunk (the policy architecture's decoder) + ``head``: Linear(hidden, 1)."""

    def __init__(self, config: PretrainedConfig) -> None:
        """Random weights (the caller sets them: ``new_value_model`` or a checkpoint); the
        caller's torch RNG is left as it was."""
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=ATTENTION)
            self.trunk = lm.get_decoder()
            self.head = torch.nn.Linear(int(config.hidden_size), 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """``[B, T-1]`` values of a right-padded batch in the trainer's next-token layout:
        entry ``[b, j]`` is V of the prefix ``input_ids[b, :j+1]``, the state in which token
        j+1 is emitted (the same positions as the policy's logprobs)."""
        key_mask = attention_mask.to(torch.bool)
        out = self.trunk(input_ids=input_ids, attention_mask=key_mask.long(),
                         position_ids=positions_from_mask(key_mask), use_cache=False)
        return self.head(out.last_hidden_state[:, :-1].float()).squeeze(-1)


def new_value_model(config: PretrainedConfig, policy_state: dict[str, torch.Tensor], seed: int) -> ValueModel:
    """A critic whose trunk holds the policy's ``policy_state`` (``export_state_dict`` names)
    and whose head is N(0, 1/(hidden+1)) with zero bias (OpenRLHF's init), drawn from the
    run seed. The caller's torch RNG is left as it was."""
    critic = ValueModel(config)
    with torch.random.fork_rng(devices=[]):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=ATTENTION)
        load_exported_state_dict(lm, policy_state)
        torch.manual_seed(derive_seed("critic-init", seed) % (1 << 63))
        with torch.no_grad():
            critic.trunk.load_state_dict(lm.get_decoder().state_dict())
            critic.head.weight.normal_(0.0, 1.0 / (int(config.hidden_size) + 1))
            critic.head.bias.zero_()
    critic.train()
    return critic


def critic_lr(hp: TrainSpec) -> float:
    """``critic_lr``, or the policy's ``lr`` when unset (constant: no warm-up schedule)."""
    return hp.lr if hp.critic_lr is None else hp.critic_lr


class Critic:
    """The value model, its AdamW and how many PPO steps it has trained (``critic_warmup_steps``)."""

    def __init__(self, model: ValueModel, hp: TrainSpec) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(list(model.parameters()), lr=critic_lr(hp), betas=hp.betas, eps=hp.eps,
                                           weight_decay=hp.weight_decay, foreach=False)
        self.steps = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Contiguous copies of every critic tensor (what a checkpoint holds)."""
        return {k: v.detach().contiguous().clone() for k, v in self.model.state_dict().items()}

    def save(self, folder: Path) -> dict:
        """Its weights and AdamW state into ``folder`` (``CRITIC_WEIGHTS``, ``CRITIC_OPTIM``);
        returns what the trainer's meta records of it (steps, param groups, checksum)."""
        files, meta = self.parts()
        for name, tensors in files.items():
            save_file(tensors, str(folder / name))
        return meta

    def parts(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """What ``save`` writes (copies, by file name) and what it returns."""
        sd = self.state_dict()
        tensors, groups = optimizer_tensors(self.optimizer)
        meta = {"steps": self.steps, "optimizer_param_groups": groups, "checksum": weights_checksum(sd)}
        return {CRITIC_WEIGHTS: sd, CRITIC_OPTIM: tensors}, meta

    @classmethod
    def restore(cls, folder: Path, meta: dict, config: PretrainedConfig, hp: TrainSpec) -> Critic:
        """The critic ``save`` wrote into ``folder`` (``meta``: what it returned), for a policy
        of architecture ``config``; its weights must have the recorded checksum."""
        critic = cls(ValueModel(config), hp)
        with torch.no_grad():
            critic.model.load_state_dict(load_file(str(folder / CRITIC_WEIGHTS)))
        got = weights_checksum(critic.state_dict())
        if got != meta["checksum"]:
            raise ValueError(f"{folder / CRITIC_WEIGHTS}: critic checksum {got} != recorded {meta['checksum']}")
        load_optimizer_tensors(critic.optimizer, load_file(str(folder / CRITIC_OPTIM)), meta["optimizer_param_groups"])
        critic.steps = int(meta["steps"])
        critic.model.train()
        return critic

    def start_step(self, hp: TrainSpec) -> None:
        for group in self.optimizer.param_groups:
            group.update(lr=critic_lr(hp), betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay)
        self.optimizer.zero_grad(set_to_none=True)

    def take_step(self, hp: TrainSpec) -> float:
        """Clip the critic's grads to ``hp.grad_clip`` and step; the norm before clipping.
        A non-finite norm is a FloatingPointError and the critic stays as it was."""
        norm = float(torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), hp.grad_clip))
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"critic: grad norm is not finite ({norm})")
        self.optimizer.step()
        return norm
