"""Where a trainer process computes: ``use_device`` makes its ``--device`` the default
(the trainer process at its start, and each rank of a fsdp2 cell on its GPU)."""

from __future__ import annotations

import torch


def use_device(device: str) -> None:
    """Make ``device`` this process's default: models load there and every tensor the
    trainer builds (batches, masks, rewards) is created there, so the CPU code is the CUDA
    code. Training stays float32 (fp32 weights, fp32 AdamW, TF32 off) for bitwise replay;
    cuBLAS determinism comes from CUBLAS_WORKSPACE_CONFIG (``gpu_runtime.proc.devices``)."""
    if device == "cpu":
        return
    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise SystemExit(f"--device {device}: no CUDA device visible to the trainer")
    torch.cuda.set_device(torch.device(device))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_default_device(device)


__all__ = ["use_device"]
