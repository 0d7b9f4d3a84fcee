"""Runs inside a vLLM server's worker (``--worker-extension-cls``), in vLLM's own venv: the served
weights hashed the way the trainer hashes its own (``model_folder.weights_checksum``), so the fleet's
checksum gate compares a vLLM engine with the trainer exactly as it compares a torch engine.

vLLM fuses some Hugging Face parameters: ``qkv_proj`` holds q, k and v stacked along the output
dimension, ``gate_up_proj`` gate and up. They are split back under their Hugging Face names; a tied
``lm_head`` is one parameter with the embedding (hashed once, as ``weights_checksum`` does), and
the vocabulary's padding rows are left out. The
tensors are vLLM's own (no copy), so a weight that vLLM reloaded wrongly changes the checksum.
One worker (tensor parallel 1): its parameters are whole.

On CPU, vLLM packs each linear layer's weight for its GEMM kernel and then drops the weight
(``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``: an empty tensor is left). Imported
into the worker before the model loads, this module makes it keep the weight the packed copy was
made from, so there is something to hash: the linear weights take twice their memory on a CPU node.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gpu_runtime.models.model_folder import weights_checksum


def keep_cpu_linear_weights() -> bool:
    """Make vLLM's CPU linear layers keep their weight after packing it (see the module's doc).
    False where vLLM is not installed (the project's own venv imports this module for its tests)."""
    try:
        from vllm.model_executor.layers import utils
    except ImportError:
        return False
    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "keeps_weight", False):
        return True

    def keep(layer: torch.nn.Module, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    vars(keep)["keeps_weight"] = True  # the mark read above (a function's attribute, unknown to a type checker)
    utils.dispatch_cpu_unquantized_gemm = keep
    return True


keep_cpu_linear_weights()


def hf_tensors(params: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """vLLM's (Qwen2 / Llama family) parameters under the Hugging Face names."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = config.num_key_value_heads * head_dim
    out: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = t[: config.vocab_size]  # vLLM pads the vocabulary (to a multiple of 64)
        elif ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), torch.split(t, [q, kv, kv], dim=0)):
                out[name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            gate, up = torch.chunk(t, 2, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        else:
            out[name] = t
    return out


class WeightsChecksum:
    """Mixed into vLLM's worker class; ``/collective_rpc`` calls ``milestone_weights_checksum`` and
    ``milestone_load_folder``."""

    model_runner: Any
    vllm_config: Any
    device: torch.device

    def milestone_load_folder(self, path: str) -> None:
        """Load a version folder's weights in place: vLLM's own ``model.load_weights`` (which fuses
        q/k/v and gate/up), then its post-load processing again (on CPU: the GEMM packing, from the
        kept weights). vLLM 0.32's ``reload_weights`` leaves a CPU model broken: measured 16 nats from
        a ``transformers`` forward of either version after a reload (docs/engines-vllm.md)."""
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        model = self.model_runner.get_model()
        with torch.no_grad():
            model.load_weights(load_file(str(Path(path) / "model.safetensors")).items())
        process_weights_after_loading(model, self.vllm_config.model_config, self.device)

    def milestone_weights_checksum(self) -> str:
        model = self.model_runner.get_model()
        params = {n: p.data for n, p in model.named_parameters()}
        return weights_checksum(hf_tensors(params, self.vllm_config.model_config.hf_config))

