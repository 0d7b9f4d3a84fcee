"""The megatron trainer's state on disk (a checkpoint's content), restored bitwise.

The same files as ``trainer.state`` where they mean the same: ``policy.safetensors`` (the
weights in HF naming: the conversion is a pure reshape, so the file is the published
version's weights and its checksum theirs), ``optimizer.safetensors`` (AdamW's state by
parameter index, in the GPTModel's parameter order), ``rng.safetensors`` (torch's CPU
generator, and on CUDA the device's and megatron-core's model-parallel RNG tracker's),
the HF config and tokenizer (so ``from_state`` can rebuild), and ``trainer_meta.json``
last, with ``backend: megatron``: its optimizer state is not in an HF trainer's parameter
order, so each backend refuses the other's checkpoint by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from gpu_runtime.models.causal_lm import config_shape
from gpu_runtime.models.model_folder import weights_checksum
from gpu_runtime.trainer.api import stored_hparams
from gpu_runtime.trainer.policy.state import (
    META_FILE,
    OPTIM_FILE,
    RNG_FILE,
    WEIGHTS_FILE,
    _load_optimizer,
    _optimizer_tensors,
    read_meta,
    restore_progress,
    write_meta,
)

if TYPE_CHECKING:
    from gpu_runtime.trainer.megatron.trainer import MegatronTrainer

BACKEND = "megatron"
_TRACKER = "megatron_tracker."


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = torch.cuda.get_rng_state()
        from megatron.core import tensor_parallel

        out.update({_TRACKER + k: v for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()})
    return out


def _set_rng(t: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(t["torch_cpu"])
    if "torch_cuda" in t and torch.cuda.is_available():
        torch.cuda.set_rng_state(t["torch_cuda"])
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(
            {k.removeprefix(_TRACKER): v for k, v in t.items() if k.startswith(_TRACKER)})


def save(trainer: MegatronTrainer, folder: str | Path) -> None:
    """Write the trainer's full state into ``folder`` (meta file last)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = trainer.published_state()
    save_file(weights, str(folder / WEIGHTS_FILE))
    trainer.hf_config.save_pretrained(str(folder))
    if trainer.generation_config is not None:
        trainer.generation_config.save_pretrained(str(folder))
    trainer.tokenizer.save(folder)
    tensors, groups = _optimizer_tensors(trainer.optimizer)
    save_file(tensors, str(folder / OPTIM_FILE))
    save_file(_rng_tensors(), str(folder / RNG_FILE))
    write_meta(folder, {
        "backend": BACKEND,
        "policy_version": trainer.policy_version,
        "opt_steps": trainer.opt_steps,
        "seed": trainer.seed,
        "model_config": config_shape(trainer.hf_config),
        "hparams": trainer.hparams.model_dump(mode="json"),
        "has_reference": False,
        "lora": None,
        "optimizer_param_groups": groups,
        "critic": None,
        "checksum": weights_checksum(weights),
    })


def load(trainer: MegatronTrainer, folder: str | Path) -> None:
    """Restore the trainer's weights, optimizer, schedule, RNGs and version from ``folder``."""
    from gpu_runtime.trainer.megatron.model import load_hf_weights

    folder = Path(folder)
    meta = read_meta(folder)
    where = folder / META_FILE
    if meta.get("backend") != BACKEND:
        raise ValueError(f"{where}: field 'backend' is {meta.get('backend', 'single')!r}: a checkpoint of another "
                         "trainer backend (its optimizer state is in another parameter order); the run's "
                         "trainer.backend is megatron")
    if config_shape(trainer.hf_config) != meta["model_config"]:
        raise ValueError(f"{where}: field 'model_config' does not match this trainer's model")
    device = str(next(trainer.model.parameters()).device)
    with torch.no_grad():
        load_hf_weights(trainer.model, load_file(str(folder / WEIGHTS_FILE), device=device), trainer.hf_config)
    trainer.hparams = stored_hparams(meta["hparams"])
    trainer.optimizer = trainer._new_optimizer(trainer.hparams)
    _load_optimizer(trainer.optimizer, load_file(str(folder / OPTIM_FILE)), meta["optimizer_param_groups"])
    _set_rng(load_file(str(folder / RNG_FILE)))
    restore_progress(trainer, meta, folder / WEIGHTS_FILE)
    trainer.model.train()
