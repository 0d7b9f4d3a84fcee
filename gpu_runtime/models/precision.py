"""The trainer's compute precision (``train.precision``): what a policy forward runs in.

``fp32`` runs everything in float32 (the default, and the only mode before the knob).
``bf16`` is mixed precision with float32 master weights: only the model's forward (and so
its backward) runs under ``torch.autocast(dtype=bfloat16)``, which computes matmuls in
bf16 from the float32 parameters; the parameters, their gradients and AdamW's states stay
float32. The logits leave the autocast region as float32 and everything downstream
(log_softmax, logprobs, ratios, advantages, the loss and its aggregation) runs in float32
outside it, so only the network's own arithmetic is rounded to bf16.

Autocast, not a bf16 copy of the weights: it needs no second copy to keep in sync, works
the same on CPU (CI) and CUDA, and gives an FSDP2 cell's ranks the single trainer's
arithmetic (``gpu_runtime.trainer.fsdp2.rank``). Deterministic as float32 is: the same
kernels in the same order for the same inputs (fixed threads on CPU; deterministic
algorithms on CUDA).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}  # None: no autocast


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (None: plain float32)."""
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ValueError(f"train.precision must be one of {sorted(PRECISIONS)}, got {precision!r}") from None


@contextlib.contextmanager
def forward_precision(precision: str, device: torch.device | str) -> Iterator[None]:
    """The region a model forward runs in: autocast to bf16 on ``device``'s type for
    ``bf16``; nothing at all for ``fp32`` (today's float32 code path, bitwise)."""
    dtype = autocast_dtype(precision)
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=torch.device(device).type, dtype=dtype):
        yield


__all__ = ["PRECISIONS", "autocast_dtype", "forward_precision"]
