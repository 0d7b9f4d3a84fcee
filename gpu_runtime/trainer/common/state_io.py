"""The trainer-state files every backend's checkpoint shares, and the parts that save and
load themselves into them.

A trainer-state folder holds ``policy.safetensors`` (the trained weights), ``optimizer.safetensors``
(AdamW's state as flat ``<param index>.<name>`` tensors; its param groups go into the meta),
``rng.safetensors`` (torch's generators) and ``trainer_meta.json``, written last: its
``format``, the backend's fields (policy version, LR-schedule position, seed, hparams,
checksum, ...) and the Python RNG's state. The HF trainer (``policy.trainer``), a fsdp2
rank (``fsdp2.rank``, its own meta file) and the megatron trainer each compose these parts.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Protocol

import torch

META_FILE = "trainer_meta.json"
WEIGHTS_FILE = "policy.safetensors"
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
    meta = {"format": format_version, **fields}
    meta.setdefault("python_random", python_rng_state())  # a snapshot's fields carry the state it was taken at
    tmp = folder / (name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    tmp.replace(folder / name)


# ---- the RNG part -------------------------------------------------------------------
def python_rng_state() -> list[Any]:
    """The Python RNG's state as JSON can hold it."""
    v, internal, gauss = random.getstate()
    return [v, list(internal), gauss]


def set_python_rng_state(saved: list[Any]) -> None:
    v, internal, gauss = saved
    random.setstate((v, tuple(internal), gauss))


# ---- the optimizer part ---------------------------------------------------------------
def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """An optimizer's state as flat ``<param index>.<name>`` tensors (copies), and its param groups."""
    views, groups = optimizer_views(opt)
    return {k: t.contiguous().clone() for k, t in views.items()}, groups


def optimizer_views(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """``optimizer_tensors`` without the copy: the live state tensors, detached."""
    osd = opt.state_dict()
    tensors = {f"{idx}.{name}": t.detach()
               for idx, st in osd["state"].items() for name, t in st.items() if isinstance(t, torch.Tensor)}
    return tensors, osd["param_groups"]


def load_optimizer_tensors(opt: torch.optim.Optimizer, flat: dict[str, torch.Tensor], groups: list[dict]) -> None:
    """Load what ``optimizer_tensors`` returned into ``opt`` (an optimizer over the same parameters)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        idx, _, name = key.partition(".")
        state.setdefault(int(idx), {})[name] = t
    for g in groups:
        g["betas"] = tuple(g["betas"])
    opt.load_state_dict({"state": state, "param_groups": groups})


# ---- the progress part ----------------------------------------------------------------
class Progress(Protocol):
    """A trainer's progress: its version, its LR-schedule position, its seed, and the
    checksum of the weights they belong to."""

    policy_version: int
    opt_steps: int
    seed: int

    def checksum(self) -> str: ...


def restore_progress(trainer: Progress, meta: dict, weights: Path) -> None:
    """The Python RNG, policy version, optimizer-step count and seed ``write_meta`` recorded;
    then the trainer's weights must have the recorded checksum (``weights`` names their file)."""
    set_python_rng_state(meta["python_random"])
    trainer.policy_version = int(meta["policy_version"])
    trainer.opt_steps = int(meta["opt_steps"])
    trainer.seed = int(meta["seed"])
    got = trainer.checksum()
    if got != meta["checksum"]:
        raise ValueError(f"{weights}: weights checksum {got} != recorded {meta['checksum']}")


__all__ = ["FORMAT_VERSION", "META_FILE", "OPTIM_FILE", "Progress", "RNG_FILE", "WEIGHTS_FILE",
           "load_optimizer_tensors", "optimizer_tensors", "optimizer_views", "python_rng_state", "read_meta", "restore_progress",
           "set_python_rng_state", "write_meta"]
