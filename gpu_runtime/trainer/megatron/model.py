"""A Megatron-core GPTModel built from an HF model folder, with the folder's weights
(``convert.hf_to_megatron``). Imports megatron-core lazily; training it needs CUDA
(megatron-core runs no forward on CPU), so ``tests/gpu`` covers the forward, while
``tests/unit/test_megatron_convert.py`` builds it on CPU to check names and shapes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from gpu_runtime.proc.processes import free_port
from gpu_runtime.trainer.megatron import config as mconfig
from gpu_runtime.trainer.megatron.convert import Shape, hf_to_megatron, megatron_to_hf


def init_single_process(port: int = 0, seed: int = 0) -> None:
    """A world of one (gloo on CPU, nccl on CUDA) and Megatron's parallel state (TP=PP=1);
    on CUDA also its model-parallel RNG tracker, which GPU weight init draws from."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if port or "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(port or free_port())
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_gpt(hf_config: Any, *, cpu_init: bool = False) -> Any:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = mconfig.transformer_config(hf_config)
    cfg.use_cpu_initialization = cpu_init
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), **mconfig.gpt_model_kwargs(hf_config))


def load_hf_weights(gpt: Any, hf_sd: dict[str, torch.Tensor], hf_config: Any) -> None:
    """Copy HF-named weights into ``gpt`` (strict on every real tensor)."""
    sd = hf_to_megatron(hf_sd, Shape.of(hf_config))
    own = {k for k in gpt.state_dict() if not k.endswith("._extra_state")}
    if set(sd) != own:
        raise ValueError(f"names differ: missing {sorted(own - set(sd))[:5]} extra {sorted(set(sd) - own)[:5]}")
    gpt.load_state_dict(sd, strict=False)


def export_hf_weights(gpt: Any, hf_config: Any) -> dict[str, torch.Tensor]:
    """``gpt``'s weights in HF naming (what engines load): ``export_state_dict`` layout."""
    sd = {k: v.detach() for k, v in gpt.state_dict().items() if isinstance(v, torch.Tensor)}  # not _extra_state
    return megatron_to_hf(sd, Shape.of(hf_config))


def from_folder(folder: str | Path, *, cpu_init: bool = False) -> tuple[Any, Any]:
    """(GPTModel with the folder's weights, the HF config)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    gpt = build_gpt(hf_config, cpu_init=cpu_init)
    load_hf_weights(gpt, load_file(str(Path(folder) / "model.safetensors")), hf_config)
    return gpt, hf_config
