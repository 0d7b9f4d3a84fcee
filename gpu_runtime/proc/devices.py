"""Where a node's trainer and engines run: the device choice of ``workers.gpu``.

``--device cpu`` puts everything on the CPU. ``--device cuda`` places the trainer on
``cuda:<trainer_gpu>`` and the engines on ``engine_gpus`` (round robin over the list):
the default list is the trainer's GPU, so one GPU holds both (colocated); naming other
GPUs gives each engine its own (disaggregated). A ``trainer.backend: fsdp2`` cell takes one
GPU per rank from ``cell_gpus``: every GPU no engine holds, and the trainer's (so engines on
their own GPUs never share one with a rank). The choice is made once, when the agent
starts, from the GPU count torch reports, so a bad placement is refused before any run
binds the node. Pure logic: the GPU count is an argument (tests pass one on CPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# cuBLAS is deterministic only with a fixed workspace; torch.use_deterministic_algorithms
# refuses CUDA matmuls without it (set before CUDA starts in the child process)
CUBLAS_DETERMINISM = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


@dataclass(frozen=True)
class Placement:
    trainer: str  # "cpu" or "cuda:N"
    engines: tuple[str, ...]  # one device per engine slot, cycled when there are more slots
    cell_gpus: tuple[int, ...] = ()  # the GPUs a fsdp2 cell's ranks may take (the Ray the trainer starts sees these)

    def engine_device(self, slot: int) -> str:
        return self.engines[slot % len(self.engines)]

    @property
    def uses_cuda(self) -> bool:
        return self.trainer.startswith("cuda") or any(d.startswith("cuda") for d in self.engines)


def parse_gpu_list(text: str | None, flag: str = "--engine-gpus") -> list[int] | None:
    """``"0,1"`` -> [0, 1]; empty/None -> None (the default placement)."""
    if text is None or not text.strip():
        return None
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} {text!r}: a comma-separated list of GPU indices, e.g. 0,1") from None
    if any(i < 0 for i in out):
        raise ValueError(f"{flag} {text!r}: GPU indices are >= 0")
    return out


def plan_placement(
    device: str, gpu_count: int, *, trainer_gpu: int = 0, engine_gpus: list[int] | None = None
) -> Placement:
    """The node's placement, or ValueError naming the flag that cannot be honoured."""
    if device == "cpu":
        if engine_gpus:
            raise ValueError("--engine-gpus needs --device cuda")
        return Placement("cpu", ("cpu",))
    if device != "cuda":
        raise ValueError(f"--device {device!r}: cpu or cuda")
    if gpu_count <= 0:
        raise ValueError("--device cuda: torch sees no CUDA device on this node (torch.cuda.device_count() == 0)")
    wanted = [trainer_gpu, *(engine_gpus or [])]
    bad = sorted({i for i in wanted if i >= gpu_count})
    if bad:
        raise ValueError(f"GPU index {bad} out of range: this node has {gpu_count} GPU(s) (0..{gpu_count - 1})")
    engines = tuple(f"cuda:{i}" for i in (engine_gpus or [trainer_gpu]))
    engine_only = set(engine_gpus or ()) - {trainer_gpu}
    cell = (trainer_gpu, *(i for i in range(gpu_count) if i != trainer_gpu and i not in engine_only))
    return Placement(f"cuda:{trainer_gpu}", engines, cell)


def gpu_list(ids: tuple[int, ...] | list[int]) -> str:
    """``parse_gpu_list``'s inverse: ``(0, 1)`` -> ``"0,1"``."""
    return ",".join(str(i) for i in ids)


def child_env(device: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a trainer or engine process on ``device``."""
    env = dict(os.environ if base is None else base)
    if device.startswith("cuda"):
        env.update({k: v for k, v in CUBLAS_DETERMINISM.items() if k not in env})
    return env


def cuda_device_count() -> int:
    """torch's GPU count (0 without a CUDA build or driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
