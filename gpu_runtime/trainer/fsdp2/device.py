"""Where a fsdp2 cell's rank computes and which ``torch.distributed`` backend its group uses.

The cell trains where its trainer process does (``--device``): on the CPU its ranks use
gloo; on CUDA each rank takes one GPU of its own and the group uses NCCL. A rank's GPU is
the one Ray assigned its actor (Ray sets ``CUDA_VISIBLE_DEVICES`` to the assigned ids, so
the rank sees it as ``cuda:0``), else ``LOCAL_RANK`` (a torchrun-style launch), else its
rank (one process per GPU on one node). The choice is pure logic over what the process
sees (tested on CPU); ``prepare_rank`` then applies it with the single trainer's
determinism settings (fixed threads, deterministic algorithms, TF32 off, cuBLAS workspace).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu_runtime.proc.devices import CUBLAS_DETERMINISM, cuda_device_count
from gpu_runtime.trainer.common.device import use_device


@dataclass(frozen=True)
class RankPlacement:
    backend: str  # "gloo" (CPU) or "nccl" (CUDA)
    device: str  # "cpu" or "cuda:N", N as this process numbers its visible GPUs


def cell_kind(trainer_device: str) -> str:
    """``cpu`` or ``cuda``: where a cell driven by a trainer process on ``trainer_device`` trains."""
    kind = trainer_device.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"trainer device {trainer_device!r}: a fsdp2 cell trains on cpu or cuda")
    return kind


def rank_bundle(kind: str, cpus_per_rank: float) -> dict[str, float]:
    """One rank's share of the cell's Ray placement group: its CPUs, and one GPU on CUDA."""
    return {"CPU": cpus_per_rank, **({"GPU": 1.0} if cell_kind(kind) == "cuda" else {})}


def rank_placement(kind: str, *, rank: int, ray_gpu_ids: Sequence[int | str] = (),
                   visible_devices: str | None = None, local_rank: str | None = None,
                   gpu_count: int = 0) -> RankPlacement:
    """The backend and device of rank ``rank`` of a cell on ``kind``, or ValueError saying
    why this process cannot be that rank (no GPU, not exactly one assigned, out of range)."""
    if cell_kind(kind) == "cpu":
        return RankPlacement("gloo", "cpu")
    if gpu_count <= 0:
        raise ValueError(f"rank {rank} of a cuda cell: this process sees no CUDA device")
    if ray_gpu_ids:
        if len(ray_gpu_ids) != 1:
            raise ValueError(f"rank {rank} of a cuda cell: Ray assigned GPUs {list(ray_gpu_ids)}, "
                             "a rank takes exactly one")
        gid = str(ray_gpu_ids[0])
        visible = [v.strip() for v in visible_devices.split(",") if v.strip()] if visible_devices else []
        if visible and gid not in visible:
            raise ValueError(f"rank {rank} of a cuda cell: Ray assigned GPU {gid}, not among "
                             f"CUDA_VISIBLE_DEVICES={visible_devices}")
        index = visible.index(gid) if visible else int(gid)
    elif local_rank is not None and local_rank.strip():
        index = int(local_rank)
    else:
        index = rank
    if not 0 <= index < gpu_count:
        raise ValueError(f"rank {rank} of a cuda cell: GPU index {index} out of range "
                         f"(this process sees {gpu_count} GPU(s))")
    return RankPlacement("nccl", f"cuda:{index}")


def prepare_rank(placement: RankPlacement, threads: int) -> None:
    """This process as the single trainer process sets itself up: a fixed thread count,
    deterministic algorithms, and on CUDA its GPU as the default device with TF32 off and
    cuBLAS's fixed workspace (set here before the first CUDA call when Ray did not)."""
    torch.set_num_threads(threads)  # a fixed thread count: the step is bitwise reproducible
    if placement.device != "cpu":
        for k, v in CUBLAS_DETERMINISM.items():
            os.environ.setdefault(k, v)
        use_device(placement.device)
    torch.use_deterministic_algorithms(True)


def this_rank(kind: str, rank: int) -> RankPlacement:
    """``rank_placement`` from what this process sees (inside a Ray actor: its assigned GPUs)."""
    if cell_kind(kind) == "cpu":
        return rank_placement("cpu", rank=rank)
    ids: list[int | str] = []
    try:
        import ray

        if ray.is_initialized():
            ids = list(ray.get_gpu_ids())
    except ImportError:
        pass
    return rank_placement("cuda", rank=rank, ray_gpu_ids=ids, visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                          local_rank=os.environ.get("LOCAL_RANK"), gpu_count=cuda_device_count())


__all__ = ["RankPlacement", "cell_kind", "prepare_rank", "rank_bundle", "rank_placement", "this_rank"]
