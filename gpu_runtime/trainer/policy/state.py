"""A ``PolicyTrainer``'s state folder: what ``save_state`` writes and ``load_state`` reads,
composed of parts that save and load themselves (the trained weights and the reference:
``PolicyTrainer.trained_state`` / ``reference_state``; AdamW and its schedule:
``common.optim``; the critic: ``policy.critic``; RNGs and progress: ``common.state_io``).

A snapshot (``state_snapshot``) is the same folder held in memory: taken now (into reused
``SnapshotBuffers``, or as live views), written later on the checkpoint store's upload thread.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from gpu_runtime.models.causal_lm import ATTENTION, exported_tensors, shape_summary
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.trainer.common import lora as lora_lib, state_io
from gpu_runtime.trainer.common.snapshot import SnapshotBuffers, StateSnapshot
from gpu_runtime.trainer.policy import critic as critic_lib
from spec.train import TrainSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from spec.model import LoraSpec


class StatefulPolicy(Protocol):
    """What the state folder reads and writes of a ``PolicyTrainer`` (declared here, so this
    module does not import the trainer it serves)."""

    model: PreTrainedModel
    ref_model: PreTrainedModel | None
    tokenizer: Tokenizer
    hparams: TrainSpec
    seed: int
    lora: LoraSpec | None
    optimizer: torch.optim.AdamW
    opt_steps: int
    policy_version: int
    critic: critic_lib.Critic | None

    def checksum(self) -> str: ...
    def policy_config(self) -> PretrainedConfig: ...
    def load_trained_state(self, sd: dict[str, torch.Tensor]) -> None: ...
    def load_reference_state(self, sd: dict[str, torch.Tensor] | None) -> None: ...
    def load_optimizer_state(self, hp: TrainSpec, flat: dict[str, torch.Tensor], groups: list[dict]) -> None: ...

REF_FILE = "reference.safetensors"  # the KL reference's weights (beside ``state_io``'s files)


def frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
    """A frozen copy of ``model`` in eval mode (the KL reference)."""
    ref = copy.deepcopy(model)
    ref.eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def state_snapshot(trainer: StatefulPolicy, buffers: SnapshotBuffers | None = None,
                   checksum: str | None = None) -> StateSnapshot:
    """``PolicyTrainer.state_snapshot``."""
    live, groups = live_state(trainer)
    files = {name: buffers.copy(name, sd) if buffers is not None else {k: v.contiguous() for k, v in sd.items()}
             for name, sd in live.items()}
    critic_meta = None
    if trainer.critic is not None:
        critic_files, critic_meta = trainer.critic.parts()  # copies already
        files.update(critic_files)
    files[state_io.RNG_FILE] = {"torch_cpu": torch.get_rng_state()}
    meta = {
        "policy_version": trainer.policy_version, "opt_steps": trainer.opt_steps, "seed": trainer.seed,
        "model_config": shape_summary(trainer.model), "hparams": trainer.hparams.model_dump(mode="json"),
        "has_reference": trainer.ref_model is not None,
        "lora": trainer.lora.model_dump(mode="json") if trainer.lora else None,
        "optimizer_param_groups": copy.deepcopy(groups), "critic": critic_meta,
        "checksum": checksum or trainer.checksum(), "python_random": state_io.python_rng_state(),
    }
    config, tokenizer = trainer.model.config, trainer.tokenizer

    def write_static(folder: Path) -> None:
        config.save_pretrained(str(folder))  # architecture, so ``from_state`` can rebuild
        tokenizer.save(folder)

    return StateSnapshot(files, meta, write_static)


def live_state(trainer: StatefulPolicy) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict]]:
    """``PolicyTrainer.live_state``."""
    files = {state_io.WEIGHTS_FILE: _model_tensors(trainer, trainer.model)}
    if trainer.ref_model is not None:
        files[REF_FILE] = _model_tensors(trainer, trainer.ref_model)
    optim, groups = state_io.optimizer_views(trainer.optimizer)
    files[state_io.OPTIM_FILE] = optim
    return files, groups


def _model_tensors(trainer: StatefulPolicy, model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """``PolicyTrainer.trained_state`` without its copy: the live weights (detached views), or
    the adapters."""
    return lora_lib.adapter_state_dict(model) if trainer.lora else exported_tensors(model)


def model_from_state(folder: str | Path) -> tuple[PreTrainedModel, PreTrainedModel | None, dict]:
    """The model (and its frozen reference, when the state has one) rebuilt from a state folder's
    architecture, before its weights are loaded; and the folder's meta. Full fine-tuning only."""
    meta = state_io.read_meta(Path(folder))
    if meta.get("lora"):
        raise ValueError(f"{folder}: a LoRA checkpoint holds adapters only: build the trainer from its base model")
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=ATTENTION)
    return model, frozen_copy(model) if meta["has_reference"] else None, meta


def load_state(trainer: StatefulPolicy, folder: str | Path) -> None:
    """``PolicyTrainer.load_state``."""
    folder = Path(folder)
    meta = state_io.read_meta(folder)
    check_compatible(trainer, folder / state_io.META_FILE, meta)
    trainer.load_trained_state(load_file(str(folder / state_io.WEIGHTS_FILE)))
    trainer.load_reference_state(load_file(str(folder / REF_FILE)) if meta["has_reference"] else None)
    trainer.hparams = TrainSpec.model_validate(meta["hparams"])
    trainer.load_optimizer_state(trainer.hparams, load_file(str(folder / state_io.OPTIM_FILE)),
                                 meta["optimizer_param_groups"])
    # None when the checkpoint has no critic: a PPO run's first step creates it
    critic = meta.get("critic")
    trainer.critic = (None if critic is None
                      else critic_lib.Critic.restore(folder, critic, trainer.policy_config(), trainer.hparams))
    torch.set_rng_state(load_file(str(folder / state_io.RNG_FILE))["torch_cpu"])
    state_io.restore_progress(trainer, meta, folder / state_io.WEIGHTS_FILE)
    trainer.model.train()


def check_compatible(trainer: StatefulPolicy, where: Path, meta: dict) -> None:
    """A checkpoint of this backend, this model and this LoRA setting, or ValueError."""
    if meta.get("backend", "single") == "megatron":  # gpu_runtime.trainer.megatron.trainer
        raise ValueError(f"{where}: field 'backend' is 'megatron': a checkpoint of trainer.backend "
                         "megatron (its optimizer state is in the GPTModel's parameter order); restore it with "
                         "trainer.backend megatron")
    if shape_summary(trainer.model) != meta["model_config"]:
        raise ValueError(f"{where}: field 'model_config' does not match this trainer's model")
    mine = trainer.lora.model_dump(mode="json") if trainer.lora else None
    if meta.get("lora") != mine:
        raise ValueError(f"{where}: field 'lora' is {meta.get('lora')}, the run's model.lora is {mine}")


__all__ = ["REF_FILE", "StatefulPolicy", "check_compatible", "frozen_copy", "live_state", "load_state", "model_from_state",
           "state_snapshot"]
