"""A model folder in Hugging Face ``save_pretrained`` layout.

``config.json`` (+ ``generation_config.json``), ``model.safetensors``, the
tokenizer files and ``milestone.json`` (weight version + checksum). Engines load
it at start and on ``/update_weights_from_disk``; the trainer writes one per
policy version; ``transformers`` loads it as is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import GenerationConfig, PretrainedConfig, PreTrainedModel

from gpu_runtime.models.causal_lm import (
    exported_tensors,
    load_causal_lm,
    load_exported_state_dict,
)
from gpu_runtime.models.safetensors_file import Spares, tensor_bytes, write_safetensors
from gpu_runtime.models.tokenizer import Tokenizer

WEIGHTS_FILE = "model.safetensors"
META_FILE = "milestone.json"
SPARES_DIR = ".spares"  # beside version folders: weights files of pruned ones, written over by the next export


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
        h.update(tensor_bytes(t))  # no copy (tobytes was 2/3 of the time)
    return h.hexdigest()


def model_checksum(model: PreTrainedModel) -> str:
    """``weights_checksum`` of what ``export_state_dict`` would save, without copying the
    weights first (an engine hashes after every weight push)."""
    return weights_checksum(exported_tensors(model))


def save_model_folder(
    model: PreTrainedModel, tokenizer: Tokenizer, folder: str | Path, *, weight_version: int,
    weights: dict[str, torch.Tensor] | None = None,
) -> str:
    """Write the folder atomically (temp dir + rename). Returns the weight checksum.
    ``weights``: the tensors to save instead of ``model``'s own (``export_state_dict``
    naming; ``model`` still gives the config)."""
    # the model's own tensors, uncopied: safetensors and the checksum read them (a clone of every
    # weight per exported version cost a full model's memcpy and memory)
    sd = {k: v.contiguous() for k, v in exported_tensors(model).items()} if weights is None else weights
    return write_model_folder(model.config, model.generation_config, tokenizer, folder, weight_version=weight_version,
                              weights=sd)


def write_model_folder(
    config: PretrainedConfig, generation_config: GenerationConfig | None, tokenizer: Tokenizer, folder: str | Path,
    *, weight_version: int, weights: dict[str, torch.Tensor],
) -> str:
    """``save_model_folder`` for a trainer that holds no ``transformers`` model (the megatron
    backend): HF-named ``weights`` with the config they belong to."""
    folder = Path(folder)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights_file = tmp / WEIGHTS_FILE
    spares_for(folder).take(weights_file)  # a pruned version's file: written over, no fresh pages
    checksum = _written_and_hashed(weights_file, weights)
    config.save_pretrained(str(tmp))
    if generation_config is not None:
        generation_config.save_pretrained(str(tmp))
    tokenizer.save(tmp)
    (tmp / META_FILE).write_text(json.dumps({"weight_version": weight_version, "checksum": checksum}))
    if folder.exists():
        old = folder.with_name(folder.name + ".old")
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old)
    else:
        os.replace(tmp, folder)
    return checksum


def _written_and_hashed(path: Path, weights: dict[str, torch.Tensor]) -> str:
    """Write ``weights`` to ``path`` (safetensors, over the file's pages when it exists) while
    another thread hashes them (``weights_checksum``; both release the GIL): the export costs
    the longer of the two, not their sum."""
    cpu = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    result: list[str | BaseException] = []

    def hash_them() -> None:
        try:
            result.append(weights_checksum(cpu))
        except BaseException as err:  # noqa: BLE001 - re-raised in the writing thread
            result.append(err)

    hasher = threading.Thread(target=hash_them, name="weights-checksum")
    hasher.start()
    try:
        write_safetensors(path, cpu, metadata={"format": "pt"})
    finally:
        hasher.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def spares_for(version_folder: Path) -> Spares:
    """Where the weights files of ``version_folder``'s pruned siblings wait to be written over."""
    return Spares(Path(version_folder).parent / SPARES_DIR)


def read_meta(folder: str | Path) -> dict:
    path = Path(folder) / META_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def load_model_folder(folder: str | Path) -> tuple[PreTrainedModel, Tokenizer, dict]:
    folder = Path(folder)
    return load_causal_lm(folder), Tokenizer.load(folder), read_meta(folder)


def load_weights_into(model: PreTrainedModel, folder: str | Path) -> dict:
    """Replace the model's weights in place from a folder; returns its meta."""
    folder = Path(folder)
    sd = load_file(str(folder / WEIGHTS_FILE))
    with torch.no_grad():
        load_exported_state_dict(model, sd)
    return read_meta(folder)


def link_folder(src: Path, dst: Path) -> None:
    """Hard links in ``dst`` to every file under ``src`` (nested folders keep their place): a
    copy without copying, for folders whose files are never rewritten in place."""
    for f in sorted(p for p in src.rglob("*") if p.is_file()):
        target = dst / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(f, target)


def prune_version_folders(parent: Path, newest: int, keep: int = 2, spares: Spares | None = None) -> None:
    """Delete ``v<NNNNNN>`` folders under ``parent`` older than the newest ``keep``; their
    weights files go to ``spares`` (default: ``parent``'s own) when nothing else links them."""
    oldest_kept = f"v{newest - keep + 1:06d}"
    spares = spares or Spares(parent / SPARES_DIR)
    for old in parent.glob("v*"):
        if old.name < oldest_kept:
            if old.is_dir():
                spares.salvage(old / WEIGHTS_FILE)
            shutil.rmtree(old, ignore_errors=True)
