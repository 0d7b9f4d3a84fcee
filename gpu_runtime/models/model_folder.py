"""A model folder in Hugging Face ``save_pretrained`` layout.

``config.json`` (Qwen2 config), ``model.safetensors``, tokenizer files and
``milestone.json`` (weight version + checksum). Engines load it at start and on
``/update_weights_from_disk``; the trainer writes one per policy version.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from gpu_runtime.models.causal_lm import CausalLM, ModelConfig, load_exported_state_dict, state_dict_for_export
from gpu_runtime.models.tokenizer import CharTokenizer

WEIGHTS_FILE = "model.safetensors"
META_FILE = "milestone.json"


def weights_checksum(state_dict: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, sorted by name."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        if name == "lm_head.weight" and "model.embed_tokens.weight" in state_dict:
            t0 = state_dict[name]
            if t0.data_ptr() == state_dict["model.embed_tokens.weight"].data_ptr():
                continue  # tied: hashed once
        t = state_dict[name].detach().contiguous().cpu()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def model_checksum(model: CausalLM) -> str:
    return weights_checksum(state_dict_for_export(model))


def save_model_folder(
    model: CausalLM, tokenizer: CharTokenizer, folder: str | Path, *, weight_version: int
) -> str:
    """Write the folder atomically (temp dir + rename). Returns the weight checksum."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    sd = state_dict_for_export(model)
    checksum = weights_checksum(sd)
    save_file(sd, str(tmp / WEIGHTS_FILE))
    cfg = model.config.to_hf_config(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    tokenizer.save(tmp)
    (tmp / META_FILE).write_text(json.dumps({"weight_version": weight_version, "checksum": checksum}))
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        os.replace(folder, old)
        os.replace(tmp, folder)
        for p in old.iterdir():
            p.unlink()
        old.rmdir()
    else:
        os.replace(tmp, folder)
    return checksum


def read_model_config(folder: str | Path) -> ModelConfig:
    path = Path(folder) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no config.json in model folder {folder}")
    raw = json.loads(path.read_text())
    names = {f.name for f in fields(ModelConfig)} - {"extra", "initializer_range"}
    return ModelConfig(**{k: v for k, v in raw.items() if k in names})


def read_meta(folder: str | Path) -> dict:
    path = Path(folder) / META_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def load_model_folder(folder: str | Path) -> tuple[CausalLM, CharTokenizer, dict]:
    folder = Path(folder)
    cfg = read_model_config(folder)
    model = CausalLM(cfg)
    load_exported_state_dict(model, load_file(str(folder / WEIGHTS_FILE)))
    model.eval()
    return model, CharTokenizer.load(folder), read_meta(folder)


def load_weights_into(model: CausalLM, folder: str | Path) -> dict:
    """Replace the model's weights in place from a folder; returns its meta."""
    folder = Path(folder)
    sd = load_file(str(folder / WEIGHTS_FILE))
    with torch.no_grad():
        load_exported_state_dict(model, sd)
    return read_meta(folder)


def prune_version_folders(parent: Path, newest: int, keep: int = 2) -> None:
    """Delete ``v<NNNNNN>`` folders under ``parent`` older than the newest ``keep``."""
    oldest_kept = f"v{newest - keep + 1:06d}"
    for old in parent.glob("v*"):
        if old.name < oldest_kept:
            shutil.rmtree(old, ignore_errors=True)
