"""The policy model: a Hugging Face ``transformers`` causal LM loaded from a folder.

Trainer and CPU engine run the ``transformers`` implementation of whatever
architecture the folder's ``config.json`` names (Qwen2, Llama, ...), so the
user's checkpoint is the model. Everything here is called with a key-padding
mask and explicit positions, so left-padded (generation) and right-padded
(training) batches work the same way.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, cast

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()  # no per-load bars in worker logs
KVCache = DynamicCache
# eager attention: a padded query row sees a finite mask (no NaN), and the same
# inputs give the same floats on every run (the determinism invariant)
ATTENTION = "eager"


def load_causal_lm(folder: str | Path) -> PreTrainedModel:
    """The folder's model in float32 on torch's default device (the CPU, unless a CUDA
    trainer process set its GPU: ``gpu_runtime.trainer.server --device``); no hub access:
    ``folder`` is a local directory."""
    folder = Path(folder)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"{folder}: not a model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation=ATTENTION, local_files_only=True
    )
    to_device(model, torch.get_default_device())
    model.eval()
    return model


def to_device(model: PreTrainedModel, device: torch.device | str) -> PreTrainedModel:
    """``model.to(device)``, in place, typed: transformers declares ``PreTrainedModel.to`` through
    ``functools.wraps(nn.Module.to)``, which a type checker cannot bind to the instance."""
    cast(torch.nn.Module, model).to(device)
    return model


def positions_from_mask(key_mask: torch.Tensor) -> torch.Tensor:
    """Left- or right-padded mask [B, T] -> positions counting only real tokens."""
    return (key_mask.long().cumsum(-1) - 1).clamp(min=0)


def lm_logits(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    key_mask: torch.Tensor,
    positions: torch.Tensor,
    cache: KVCache | None = None,
) -> torch.Tensor:
    """input_ids [B, T]; key_mask [B, S] bool over all keys so far (S >= T, the last T
    are the new tokens); positions [B, T]. Returns float32 logits [B, T, V]."""
    kv = {_cache_arg(type(model)): cache} if cache is not None else {}
    out = model(input_ids=input_ids, attention_mask=key_mask.long(), position_ids=positions, use_cache=cache is not None, **kv)
    return out.logits.float()


_CACHE_ARG: dict[type[torch.nn.Module], str] = {}


def _cache_arg(model_type: type[torch.nn.Module]) -> str:
    """``cache`` in newer transformers, ``past_key_values`` before (and on older GPU images); once per class."""
    if model_type not in _CACHE_ARG:
        _CACHE_ARG[model_type] = "cache" if "cache" in inspect.signature(model_type.forward).parameters \
            else "past_key_values"
    return _CACHE_ARG[model_type]


def new_cache(model: PreTrainedModel) -> KVCache:
    return DynamicCache(config=model.config)


def tied_embeddings(model: PreTrainedModel) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


def exported_tensors(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The tensors ``export_state_dict`` saves, as detached views of the model's own (no
    copy): ``save_pretrained`` naming, a tied ``lm_head`` left out."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if tied_embeddings(model):
        sd.pop("lm_head.weight", None)
    return sd


def export_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """Contiguous, untied copies of every tensor, in ``save_pretrained`` naming
    (safetensors refuses shared storage; a tied ``lm_head`` is left out)."""
    return {k: v.contiguous().clone() for k, v in exported_tensors(model).items()}


def load_exported_state_dict(model: PreTrainedModel, sd: dict[str, torch.Tensor]) -> None:
    """Load weights written by ``export_state_dict`` in place (ties kept)."""
    missing, unexpected = model.load_state_dict(sd, strict=False)
    allowed_missing = {"lm_head.weight"} if tied_embeddings(model) else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(f"weights do not match model: missing={missing} unexpected={unexpected}")
    if tied_embeddings(model):
        model.tie_weights()


SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


def config_shape(config: Any) -> dict:
    """The architecture-defining fields of an HF config (a checkpoint must match them)."""
    return {k: getattr(config, k, None) for k in SHAPE_KEYS}


def shape_summary(model: PreTrainedModel) -> dict:
    """``config_shape`` of a model's config."""
    return config_shape(model.config)
