"""The trainer's state on disk (a checkpoint's content): ``save`` writes it, ``load``
restores it bitwise. Weights are the trained tensors only (every weight, or the LoRA
adapters), plus the KL reference's, the AdamW state, the LR-schedule position, both RNGs
and the version; ``trainer_meta.json`` is written last."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from gpu_runtime.models.causal_lm import shape_summary
from gpu_runtime.trainer.api import stored_hparams

if TYPE_CHECKING:
    from gpu_runtime.trainer.policy import PolicyTrainer

META_FILE = "trainer_meta.json"
WEIGHTS_FILE = "policy.safetensors"
REF_FILE = "reference.safetensors"
OPTIM_FILE = "optimizer.safetensors"
RNG_FILE = "rng.safetensors"
FORMAT_VERSION = 1


def read_meta(folder: Path) -> dict:
    path = folder / META_FILE
    if not path.exists():
        raise FileNotFoundError(f"no {META_FILE} in trainer state folder {folder}")
    meta = json.loads(path.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: field 'format' must be {FORMAT_VERSION}, got {meta.get('format')!r}")
    return meta


def save(trainer: PolicyTrainer, folder: str | Path) -> None:
    """Write the trainer's full state into ``folder`` (meta file last)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(trainer._trained_state(trainer.model), str(folder / WEIGHTS_FILE))
    if trainer.ref_model is not None:
        save_file(trainer._trained_state(trainer.ref_model), str(folder / REF_FILE))
    trainer.model.config.save_pretrained(str(folder))  # architecture, so ``from_state`` can rebuild
    trainer.tokenizer.save(folder)
    osd = trainer.optimizer.state_dict()
    tensors = {f"{idx}.{name}": t.detach().contiguous().clone()
               for idx, st in osd["state"].items() for name, t in st.items() if isinstance(t, torch.Tensor)}
    save_file(tensors, str(folder / OPTIM_FILE))
    save_file({"torch_cpu": torch.get_rng_state()}, str(folder / RNG_FILE))
    py_state = random.getstate()
    meta = {
        "format": FORMAT_VERSION,
        "policy_version": trainer.policy_version,
        "opt_steps": trainer.opt_steps,
        "seed": trainer.seed,
        "model_config": shape_summary(trainer.model),
        "hparams": trainer.hparams.model_dump(mode="json"),
        "has_reference": trainer.ref_model is not None,
        "lora": trainer.lora.model_dump(mode="json") if trainer.lora else None,
        "optimizer_param_groups": osd["param_groups"],
        "python_random": [py_state[0], list(py_state[1]), py_state[2]],
        "checksum": trainer.checksum(),
    }
    tmp = folder / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(folder / META_FILE)


def load(trainer: PolicyTrainer, folder: str | Path) -> None:
    """Restore the trainer's weights, reference, optimizer, schedule, RNG and version from ``folder``."""
    folder = Path(folder)
    meta = read_meta(folder)
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
    flat = load_file(str(folder / OPTIM_FILE))
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        idx, _, name = key.partition(".")
        state.setdefault(int(idx), {})[name] = t
    groups = meta["optimizer_param_groups"]
    for g in groups:
        g["betas"] = tuple(g["betas"])
    trainer.optimizer.load_state_dict({"state": state, "param_groups": groups})
    torch.set_rng_state(load_file(str(folder / RNG_FILE))["torch_cpu"])
    v, internal, gauss = meta["python_random"]
    random.setstate((v, tuple(internal), gauss))
    trainer.policy_version = int(meta["policy_version"])
    trainer.opt_steps = int(meta["opt_steps"])
    trainer.seed = int(meta["seed"])
    got = trainer.checksum()
    if got != meta["checksum"]:
        raise ValueError(f"{folder / WEIGHTS_FILE}: weights checksum {got} != recorded {meta['checksum']}")
    trainer.model.train()
