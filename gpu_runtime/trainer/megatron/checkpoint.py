"""What the megatron trainer's state on disk adds to the shared files (``common.state_io``).

``MegatronTrainer.save_state`` writes the same files as the HF trainer where they mean the
same: ``policy.safetensors`` (the weights in HF naming: the conversion is a pure reshape, so
the file is the published version's weights and its checksum theirs),
``optimizer.safetensors`` (AdamW's state by parameter index, in the GPTModel's parameter
order), the HF config and tokenizer (so ``from_state`` can rebuild), and
``trainer_meta.json`` last, with ``backend: megatron``: its optimizer state is not in an HF
trainer's parameter order, so each backend refuses the other's checkpoint by name. Its RNG
part is here: ``rng.safetensors`` holds torch's CPU generator, and on CUDA the device's and
megatron-core's model-parallel RNG tracker's.
"""

from __future__ import annotations

from pathlib import Path

import torch

BACKEND = "megatron"
_TRACKER = "megatron_tracker."


def rng_tensors() -> dict[str, torch.Tensor]:
    """This process's RNG states (``rng.safetensors``)."""
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = torch.cuda.get_rng_state()
        from megatron.core import tensor_parallel  # megatron-core: the ``[gpu]`` extra

        out.update({_TRACKER + k: v for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()})
    return out


def set_rng(t: dict[str, torch.Tensor]) -> None:
    """Restore what ``rng_tensors`` returned."""
    torch.set_rng_state(t["torch_cpu"])
    if "torch_cuda" in t and torch.cuda.is_available():
        torch.cuda.set_rng_state(t["torch_cuda"])
        from megatron.core import tensor_parallel  # megatron-core: the ``[gpu]`` extra

        tensor_parallel.get_cuda_rng_tracker().set_states(
            {k.removeprefix(_TRACKER): v for k, v in t.items() if k.startswith(_TRACKER)})


def check_backend(meta: dict, where: Path) -> None:
    """A checkpoint of the megatron trainer, or ValueError naming the field."""
    if meta.get("backend") != BACKEND:
        raise ValueError(f"{where}: field 'backend' is {meta.get('backend', 'single')!r}: a checkpoint of another "
                         "trainer backend (its optimizer state is in another parameter order); the run's "
                         "trainer.backend is megatron")


__all__ = ["BACKEND", "check_backend", "rng_tensors", "set_rng"]
