"""``trainer.backend: megatron``: the policy as a megatron-core GPTModel (local layer spec,
TP = PP = 1, one process), trained with the repo's GRPO loss (``megatron.train``) and its
AdamW + LR schedule (``trainer.common.optim``), published as HF model folders engines load.

It answers the calls ``TrainerService`` makes of a ``PolicyTrainer`` for what it supports
(RL ``train_step``, ``export_model_folder``, ``checksum``, ``published_state``,
``save_state`` / ``from_state`` / ``load_state``, ``policy_version``); the run config
refuses the rest before a run starts (``spec.trainer.layout_conflicts``).
Weights go HF -> Megatron once at creation (``convert.hf_to_megatron``) and Megatron -> HF
for every published version (``convert.megatron_to_hf``): pure reshapes, so a version's
checksum is the checksum of the HF weights it stands for.

megatron-core runs no forward on CPU: training needs the node's trainer on CUDA
(``workers.gpu --device cuda``). Building, loading, exporting and checkpointing work on
CPU (that is what the CPU tests cover).
"""

from __future__ import annotations

import importlib.util
import random
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from gpu_runtime.models.causal_lm import config_shape
from gpu_runtime.models.model_folder import weights_checksum, write_model_folder
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.store.artifacts import Sample, derive_seed
from gpu_runtime.trainer.common import state_io
from gpu_runtime.trainer.common.batches import check_groups, step_metrics
from gpu_runtime.trainer.common.optim import AdamWSteps
from gpu_runtime.trainer.megatron import checkpoint, model as mm
from gpu_runtime.trainer.megatron.convert import Shape, megatron_to_hf
from gpu_runtime.trainer.megatron.model import load_hf_weights
from gpu_runtime.trainer.megatron.train import grpo_backward
from gpu_runtime.trainer.protocol import ALIVE, Health, TrainerDefaults
from spec.train import TrainSpec
from spec.trainer import megatron_train_conflicts

INSTALL = "pip install 'milestone[gpu]'"


def runtime_problem(*, need_cuda: bool = True) -> str | None:
    """Why this process cannot train ``trainer.backend megatron`` (None: it can): megatron-core
    missing, or (``need_cuda``) torch's default device, which ``trainer.server`` sets from the
    node's ``--device``, not CUDA."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        return f"trainer.backend megatron needs megatron-core ({INSTALL}); it is not installed on this node"
    dev = torch.get_default_device()
    if need_cuda and dev.type != "cuda":
        return ("trainer.backend megatron needs the node's trainer on CUDA (start the node agent with "
                f"`python -m workers.gpu --device cuda`): megatron-core runs no forward on {dev.type}")
    return None


def _refuse_hparams(hp: TrainSpec) -> None:
    if bad := megatron_train_conflicts(hp):
        raise ValueError(f"trainer.backend megatron does not support {'; '.join(bad)}")


class MegatronTrainer(AdamWSteps, TrainerDefaults):
    lora = None  # full fine-tuning only (the run config refuses model.lora)
    health: Health = ALIVE  # in the trainer process itself: a failure ends the process (``protocol``)

    def __init__(self, gpt: Any, hf_config: PretrainedConfig, generation_config: GenerationConfig | None,
                 tokenizer: Tokenizer, hparams: TrainSpec, seed: int) -> None:
        self.model = gpt
        self.hf_config = hf_config  # what the published folders' config.json says
        self.generation_config = generation_config
        self.tokenizer = tokenizer
        self.hparams = hparams
        self.seed = seed
        self.policy_version = 0
        self.opt_steps = 0
        self.optimizer = self.new_optimizer(hparams)

    # ---------------------------------------------------------------- setup
    @classmethod
    def create(cls, base_folder: str | Path, hparams: TrainSpec, seed: int, *,
               require_cuda: bool = True) -> MegatronTrainer:
        """A trainer over the weights and tokenizer of an HF folder (Qwen2 / Llama), converted to
        a GPTModel on torch's default device. ``require_cuda`` False builds one on CPU anyway
        (export and checkpoints work there; a forward does not): the CPU tests' way."""
        trainer = cls._empty(base_folder, hparams, seed, require_cuda)
        sd = load_file(str(Path(base_folder) / "model.safetensors"), device=str(_device(trainer.model)))
        with torch.no_grad():
            load_hf_weights(trainer.model, sd, trainer.hf_config)
        return trainer

    @classmethod
    def _empty(cls, folder: str | Path, hparams: TrainSpec, seed: int, require_cuda: bool) -> MegatronTrainer:
        """A trainer with the folder's architecture and tokenizer, its weights megatron-core's init."""
        if problem := runtime_problem(need_cuda=require_cuda):
            raise ValueError(problem)
        _refuse_hparams(hparams)
        tokenizer = Tokenizer.load(folder)
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        if config.vocab_size < tokenizer.vocab_size:
            raise ValueError(f"{folder}: config vocab_size {config.vocab_size} < tokenizer's {tokenizer.vocab_size}")
        gpt = build(config, seed)
        gpt.train()
        torch.manual_seed(derive_seed("trainer", seed) % (1 << 63))  # as PolicyTrainer.create: after the build
        random.seed(derive_seed("trainer-py", seed))
        return cls(gpt, config, _generation_config(folder), tokenizer, hparams, seed)

    # ------------------------------------------------------------------ RL
    def train_step(self, samples: list[Sample], rewards: list[float], group_size: int,
                   hparams: TrainSpec, temperature: float = 1.0) -> dict[str, float]:
        """One GRPO update from one rollout (one optimizer step); increments ``policy_version``.
        The same metrics as ``PolicyTrainer.train_step`` (``kl`` is 0: no reference)."""
        check_groups(samples, rewards, group_size)
        _refuse_hparams(hparams)
        t0 = time.perf_counter()
        self.hparams = hp = hparams
        self.model.train()
        lr = self.start_optimizer_step(hp)
        sums = grpo_backward(self.model, samples, rewards, group_size, hp, self.tokenizer.pad_token_id, temperature)
        grad_norm = self.take_optimizer_step(hp, "train_step")
        self.policy_version += 1
        n_tokens = sums.pop("tokens")
        return step_metrics(sums, samples, rewards, n_tokens=n_tokens, grad_norm=grad_norm, lr=lr,
                            seconds=time.perf_counter() - t0, policy_version=self.policy_version)

    def sft_step(self, rows: list[dict], hparams: TrainSpec) -> dict[str, float]:
        raise ValueError("trainer.backend megatron does not support mode sft (the RL step only)")

    # --------------------------------------------------------------- state
    def published_state(self) -> dict[str, torch.Tensor]:
        """The weights engines load for this version, in HF naming (``export_state_dict``'s layout)."""
        sd = {k: v.detach() for k, v in self.model.state_dict().items()
              if isinstance(v, torch.Tensor) and not k.endswith("._extra_state")}
        return {k: v.contiguous().clone() for k, v in megatron_to_hf(sd, Shape.of(self.hf_config)).items()}

    def checksum(self) -> str:
        return weights_checksum(self.published_state())

    def broadcast_tensors(self, exported: Path) -> dict[str, torch.Tensor]:
        """The published weights (HF naming, converted from the GPTModel's)."""
        return self.published_state()

    def export_model_folder(self, folder: str | Path) -> str:
        """This version as an HF model folder (config, generation config, tokenizer, weights,
        ``milestone.json``) that engines and ``transformers`` load as is; returns its checksum."""
        return write_model_folder(self.hf_config, self.generation_config, self.tokenizer, folder,
                                  weight_version=self.policy_version, weights=self.published_state())

    def export_adapter_folder(self, folder: str | Path, base_model: str) -> None:
        raise ValueError("export_adapter_folder: trainer.backend megatron trains no LoRA adapters")

    def save_state(self, folder: str | Path) -> None:
        """Write the full trainer state into ``folder`` (meta file last; ``megatron.checkpoint``)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        weights = self.published_state()
        save_file(weights, str(folder / state_io.WEIGHTS_FILE))
        self.hf_config.save_pretrained(str(folder))
        if self.generation_config is not None:
            self.generation_config.save_pretrained(str(folder))
        self.tokenizer.save(folder)
        tensors, groups = self.optimizer_state()
        save_file(tensors, str(folder / state_io.OPTIM_FILE))
        save_file(checkpoint.rng_tensors(), str(folder / state_io.RNG_FILE))
        state_io.write_meta(folder, {
            "backend": checkpoint.BACKEND, "policy_version": self.policy_version, "opt_steps": self.opt_steps,
            "seed": self.seed, "model_config": config_shape(self.hf_config),
            "hparams": self.hparams.model_dump(mode="json"), "has_reference": False, "lora": None,
            "optimizer_param_groups": groups, "critic": None, "checksum": weights_checksum(weights),
        })

    @classmethod
    def from_state(cls, folder: str | Path, *, require_cuda: bool = True) -> MegatronTrainer:
        """Build a trainer from a folder written by ``save_state``."""
        meta = state_io.read_meta(Path(folder))
        trainer = cls._empty(folder, TrainSpec.model_validate(meta["hparams"]), int(meta["seed"]), require_cuda)
        trainer.load_state(folder)
        return trainer

    def load_state(self, folder: str | Path) -> None:
        """Restore weights, optimizer, schedule, RNGs and version from ``folder``."""
        folder = Path(folder)
        meta = state_io.read_meta(folder)
        where = folder / state_io.META_FILE
        checkpoint.check_backend(meta, where)
        if config_shape(self.hf_config) != meta["model_config"]:
            raise ValueError(f"{where}: field 'model_config' does not match this trainer's model")
        with torch.no_grad():
            load_hf_weights(self.model, load_file(str(folder / state_io.WEIGHTS_FILE), device=str(_device(self.model))),
                            self.hf_config)
        self.hparams = TrainSpec.model_validate(meta["hparams"])
        self.load_optimizer_state(self.hparams, load_file(str(folder / state_io.OPTIM_FILE)),
                                  meta["optimizer_param_groups"])
        checkpoint.set_rng(load_file(str(folder / state_io.RNG_FILE)))
        state_io.restore_progress(self, meta, folder / state_io.WEIGHTS_FILE)
        self.model.train()


def build(config: PretrainedConfig, seed: int) -> Any:
    """An (unloaded) GPTModel for ``config`` on torch's default device, in a world of one
    (megatron-core's parallel state, TP = PP = 1)."""
    mm.init_single_process(seed=seed)
    device = torch.get_default_device()
    gpt = mm.build_gpt(config, cpu_init=device.type != "cuda")  # on CUDA megatron-core initialises on the GPU
    return gpt.to(device)


def _device(gpt: Any) -> torch.device:
    return next(gpt.parameters()).device


def _generation_config(folder: str | Path) -> GenerationConfig | None:
    try:
        return GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    except OSError:  # the folder has none
        return None


__all__ = ["INSTALL", "MegatronTrainer", "runtime_problem"]
