"""LoRA adapters (peft) on the policy: wrap, merged weights, adapter state, adapter export.

Only the adapters train. The engines get **merged** weights: every published version
is a plain model folder whose linear layers hold ``W + B @ A * alpha / r`` (computed
here, never by merging in place, so the base weights are never rounded by a
merge/unmerge). Checkpoints hold the adapters only; the base comes back from the
run's base model folder, which is rebuilt byte for byte (``model.init``) or read
(``model.path``). ``peft`` is imported only when a run uses LoRA.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from gpu_runtime.models.causal_lm import tied_embeddings
from gpu_runtime.store.artifacts import derive_seed
from spec.model import LoraSpec

if TYPE_CHECKING:
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

ADAPTER_NAME = "default"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def apply_lora(model: PreTrainedModel, lora: LoraSpec, seed: int) -> PreTrainedModel:
    """``model`` wrapped by peft with fresh adapters (A seeded from ``seed``, B zero, so the
    wrapped model computes exactly what ``model`` did); every base weight frozen. The
    caller's torch RNG is left as it was. A target that names no module is a ValueError
    naming ``model.lora.target_modules``."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        # peft declares lora_alpha an int, but only ever divides it (scaling = alpha / r); model.lora.alpha is a float
        r=lora.r, lora_alpha=lora.alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout, bias="none", task_type="CAUSAL_LM",
        target_modules=lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed("lora-init", seed) % (1 << 63))
        try:
            wrapped = get_peft_model(model, config)
        except ValueError as err:
            linear = sorted({n.split(".")[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
            raise ValueError(
                f"model.lora.target_modules {lora.target_modules!r}: {err} (the model's linear layers: {linear})"
            ) from None
    return cast(PreTrainedModel, wrapped)  # a PeftModel, which forwards the wrapped model's attributes


def _peft(model: torch.nn.Module) -> PeftModel:
    """``model`` as the PeftModel ``apply_lora`` made (its holders type it as the model it wraps)."""
    return cast("PeftModel", model)


def base_model(model: torch.nn.Module) -> PreTrainedModel:
    """The plain model ``apply_lora`` wrapped (its linear layers carry the adapters)."""
    return cast(PreTrainedModel, _peft(model).get_base_model())


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps, in module order (all of them without LoRA)."""
    return [p for p in model.parameters() if p.requires_grad]


def _lora_layers(model: torch.nn.Module) -> dict[str, LoraLayer]:
    """{plain module path: LoRA layer} over the wrapped model's base (``model.layers.0.self_attn.q_proj``)."""
    base = _peft(model).get_base_model()
    return {name: cast("LoraLayer", m) for name, m in base.named_modules()
            if hasattr(m, "lora_A") and ADAPTER_NAME in m.lora_A}


def lora_delta(layer: LoraLayer) -> torch.Tensor:
    """``B @ A * alpha / r`` of one LoRA linear layer (out x in)."""
    a = cast(torch.nn.Linear, layer.lora_A[ADAPTER_NAME]).weight
    b = cast(torch.nn.Linear, layer.lora_B[ADAPTER_NAME]).weight
    return (b @ a) * layer.scaling[ADAPTER_NAME]


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of the model the adapters define, as a plain model's ``export_state_dict``
    (``save_pretrained`` names, contiguous copies, a tied ``lm_head`` left out)."""
    base = cast(PreTrainedModel, _peft(model).get_base_model())
    layers = _lora_layers(model)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for key, value in base.state_dict().items():
            if ".lora_" in key:
                continue
            module, _, leaf = key.rpartition(".")
            plain_module = module.removesuffix(".base_layer")
            t = value.detach()
            if module.endswith(".base_layer") and leaf == "weight" and plain_module in layers:
                t = t + lora_delta(layers[plain_module])
            out[f"{plain_module}.{leaf}"] = t.contiguous().clone()
    if tied_embeddings(base):
        out.pop("lm_head.weight", None)
    return out


def _adapter_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every LoRA A and B by parameter name (also in a frozen copy, where none requires grad)."""
    return {n: p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}


def adapter_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters only (every LoRA A and B), by parameter name: what a checkpoint holds."""
    return {n: p.detach().contiguous().clone() for n, p in _adapter_parameters(model).items()}


def load_adapter_state_dict(model: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Set the adapters from ``adapter_state_dict`` output; the names must match exactly."""
    params = _adapter_parameters(model)
    if set(params) != set(sd):
        missing, unexpected = sorted(set(params) - set(sd)), sorted(set(sd) - set(params))
        raise ValueError(f"adapters do not match the model's LoRA layers: missing={missing[:4]} unexpected={unexpected[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(sd[name])


def save_adapter_folder(model: torch.nn.Module, folder: str | Path, base_model: str) -> None:
    """A peft adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) whose
    ``base_model_name_or_path`` is ``base_model``: ``PeftModel.from_pretrained(base, folder)``
    and ``AutoPeftModelForCausalLM`` load it."""
    from peft import get_peft_model_state_dict

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous().clone() for k, v in get_peft_model_state_dict(model).items()}
    save_file(sd, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = _peft(model).peft_config[ADAPTER_NAME]
    config.save_pretrained(str(folder))
    path = folder / ADAPTER_CONFIG
    saved = json.loads(path.read_text())
    saved["base_model_name_or_path"] = base_model
    path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
