"""The trainer's state on disk (a checkpoint's content): ``save`` writes it, ``load``
restores it bitwise. Weights are the trained tensors only (every weight, or the LoRA
adapters), plus the KL reference's, the AdamW state, the LR-schedule position, both RNGs
and the version; with a PPO critic also its weights, its AdamW state and its step count
(``critic.safetensors``, ``critic_optimizer.safetensors``: never published to engines);
``trainer_meta.json`` is written last."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from gpu_runtime.models.causal_lm import shape_summary
from gpu_runtime.models.model_folder import weights_checksum
from gpu_runtime.trainer.policy import critic as critic_lib
from gpu_runtime.trainer.api import stored_hparams

if TYPE_CHECKING:
    from gpu_runtime.trainer.policy.trainer import PolicyTrainer

META_FILE = "trainer_meta.json"
WEIGHTS_FILE = "policy.safetensors"
REF_FILE = "reference.safetensors"
OPTIM_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
FORMAT_VERSION = 1


def read_meta(folder: Path, name: str = META_FILE, format_version: int = FORMAT_VERSION,
              what: str = "trainer state") -> dict:
    """``folder/name``, whose ``format`` must be ``format_version``."""
    path = folder / name
    if not path.exists():
        raise FileNotFoundError(f"no {name} in {what} folder {folder}")
    meta = json.loads(path.read_text())
    if meta.get("format") != format_version:
        raise ValueError(f"{path}: field 'format' must be {format_version}, got {meta.get('format')!r}")
    return meta


def write_meta(folder: Path, fields: dict, name: str = META_FILE, format_version: int = FORMAT_VERSION) -> None:
    """``fields`` with the format and the Python RNG's state, into ``folder/name`` atomically:
    written last, so a folder that has it is whole."""
    py_state = random.getstate()
    meta = {"format": format_version, **fields, "python_random": [py_state[0], list(py_state[1]), py_state[2]]}
    tmp = folder / (name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(folder / name)


def restore_progress(trainer: Any, meta: dict, weights: Path) -> None:
    """The Python RNG, policy version, optimizer-step count and seed ``write_meta`` recorded;
    then the trainer's weights must have the recorded checksum (``weights`` names their file)."""
    v, internal, gauss = meta["python_random"]
    random.setstate((v, tuple(internal), gauss))
    trainer.policy_version = int(meta["policy_version"])
    trainer.opt_steps = int(meta["opt_steps"])
    trainer.seed = int(meta["seed"])
    got = trainer.checksum()
    if got != meta["checksum"]:
        raise ValueError(f"{weights}: weights checksum {got} != recorded {meta['checksum']}")


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """An optimizer's state as flat ``<param index>.<name>`` tensors, and its param groups."""
    osd = opt.state_dict()
    tensors = {f"{idx}.{name}": t.detach().contiguous().clone()
               for idx, st in osd["state"].items() for name, t in st.items() if isinstance(t, torch.Tensor)}
    return tensors, osd["param_groups"]


def _load_optimizer(opt: torch.optim.Optimizer, flat: dict[str, torch.Tensor], groups: list[dict]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        idx, _, name = key.partition(".")
        state.setdefault(int(idx), {})[name] = t
    for g in groups:
        g["betas"] = tuple(g["betas"])
    opt.load_state_dict({"state": state, "param_groups": groups})


def _critic_checksum(sd: dict[str, torch.Tensor]) -> str:
    return weights_checksum(sd)


def save(trainer: PolicyTrainer, folder: str | Path) -> None:
    """Write the trainer's full state into ``folder`` (meta file last)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(trainer._trained_state(trainer.model), str(folder / WEIGHTS_FILE))
    if trainer.ref_model is not None:
        save_file(trainer._trained_state(trainer.ref_model), str(folder / REF_FILE))
    trainer.model.config.save_pretrained(str(folder))  # architecture, so ``from_state`` can rebuild
    trainer.tokenizer.save(folder)
    tensors, groups = _optimizer_tensors(trainer.optimizer)
    save_file(tensors, str(folder / OPTIM_FILE))
    critic_meta = None
    if trainer.critic is not None:
        sd = trainer.critic.state_dict()
        save_file(sd, str(folder / critic_lib.CRITIC_WEIGHTS))
        c_tensors, c_groups = _optimizer_tensors(trainer.critic.optimizer)
        save_file(c_tensors, str(folder / critic_lib.CRITIC_OPTIM))
        critic_meta = {"steps": trainer.critic.steps, "optimizer_param_groups": c_groups, "checksum": _critic_checksum(sd)}
    save_file({"torch_cpu": torch.get_rng_state()}, str(folder / RNG_FILE))
    write_meta(folder, {
        "policy_version": trainer.policy_version,
        "opt_steps": trainer.opt_steps,
        "seed": trainer.seed,
        "model_config": shape_summary(trainer.model),
        "hparams": trainer.hparams.model_dump(mode="json"),
        "has_reference": trainer.ref_model is not None,
        "lora": trainer.lora.model_dump(mode="json") if trainer.lora else None,
        "optimizer_param_groups": groups,
        "critic": critic_meta,
        "checksum": trainer.checksum(),
    })


def load(trainer: PolicyTrainer, folder: str | Path) -> None:
    """Restore the trainer's weights, reference, optimizer, schedule, RNG and version from ``folder``."""
    folder = Path(folder)
    meta = read_meta(folder)
    if meta.get("backend", "single") == "megatron":  # gpu_runtime.trainer.megatron.checkpoint
        raise ValueError(f"{folder / META_FILE}: field 'backend' is 'megatron': a checkpoint of trainer.backend "
                         "megatron (its optimizer state is in the GPTModel's parameter order); restore it with "
                         "trainer.backend megatron")
    if shape_summary(trainer.model) != meta["model_config"]:
        raise ValueError(f"{folder / META_FILE}: field 'model_config' does not match this trainer's model")
    mine = trainer.lora.model_dump(mode="json") if trainer.lora else None
    if meta.get("lora") != mine:
        raise ValueError(f"{folder / META_FILE}: field 'lora' is {meta.get('lora')}, the run's model.lora is {mine}")
    with torch.no_grad():
        trainer._load_trained_state(trainer.model, load_file(str(folder / WEIGHTS_FILE)))
        if meta["has_reference"]:
            if trainer.ref_model is None:
                trainer.ref_model = trainer._frozen_copy(trainer.model)
            trainer._load_trained_state(trainer.ref_model, load_file(str(folder / REF_FILE)))
        else:
            trainer.ref_model = None
    trainer.hparams = stored_hparams(meta["hparams"])
    trainer.optimizer = trainer._new_optimizer(trainer.hparams)
    _load_optimizer(trainer.optimizer, load_file(str(folder / OPTIM_FILE)), meta["optimizer_param_groups"])
    trainer.critic = _load_critic(trainer, folder, meta.get("critic"))
    torch.set_rng_state(load_file(str(folder / RNG_FILE))["torch_cpu"])
    restore_progress(trainer, meta, folder / WEIGHTS_FILE)
    trainer.model.train()


def _load_critic(trainer: PolicyTrainer, folder: Path, meta: dict | None) -> critic_lib.Critic | None:
    """The checkpoint's critic (None when it has none: a PPO run's first step creates it)."""
    if meta is None:
        return None
    config = (trainer.model.get_base_model() if trainer.lora else trainer.model).config
    critic = critic_lib.Critic(critic_lib.ValueModel(config), trainer.hparams)
    sd = load_file(str(folder / critic_lib.CRITIC_WEIGHTS))
    with torch.no_grad():
        critic.model.load_state_dict(sd)
    got = _critic_checksum(critic.state_dict())
    if got != meta["checksum"]:
        raise ValueError(f"{folder / critic_lib.CRITIC_WEIGHTS}: critic checksum {got} != recorded {meta['checksum']}")
    _load_optimizer(critic.optimizer, load_file(str(folder / critic_lib.CRITIC_OPTIM)), meta["optimizer_param_groups"])
    critic.steps = int(meta["steps"])
    critic.model.train()
    return critic
