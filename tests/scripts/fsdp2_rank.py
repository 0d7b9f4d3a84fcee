"""One rank of a fsdp2 cell launched torchrun-style (``RANK`` / ``LOCAL_RANK`` /
``WORLD_SIZE`` / ``MASTER_*``, no Ray: the GPU image has none), with the same
``CellRankTrainer``, placement and determinism settings as a Ray actor rank; with ``SINGLE``
set, the single trainer instead. ``tests/integration/test_cuda_paths.py::run_ranks`` starts
it (``python -m tests.scripts.fsdp2_rank <model folder> cuda|cpu <precision> <out file>``):
two GRPO steps (:func:`cell_samples`), then rank 0 saves the published weights and the
steps' metrics to ``out file``."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from spec.train import TrainSpec


def cell_hparams(precision: str) -> TrainSpec:
    return TrainSpec(lr=1e-3, micro_batch_size=2, precision=precision)  # 2 micro-batches


def cell_samples(step: int) -> tuple[list, list[float]]:
    """One group of 4 samples of different lengths, and their rewards."""
    from gpu_runtime.store.artifacts import Sample

    lens = [1 + (g + step) % 3 for g in range(4)]
    samples = [Sample(sample_id=f"s{step}-p0-g{g}", prompt_index=0, group_index=g, prompt_ids=[1, 5, 6],
                      response_ids=[7, 8, 9 + g + step][: lens[g]], logprobs=[-1.0] * lens[g], weight_version=0,
                      finish_reason="length") for g in range(4)]
    return samples, [[1.0, 0.0, 0.5, 0.0], [0.0, 1.0, 0.25, 1.0]][step - 1]


def main(argv: list[str]) -> None:
    from gpu_runtime.trainer.fsdp2.device import prepare_rank, this_rank

    folder, kind, precision, out = argv[:4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    placement = this_rank(kind, rank)
    prepare_rank(placement, 1)
    dist.init_process_group(placement.backend, rank=rank, world_size=world)
    from gpu_runtime.trainer.fsdp2.rank import CellRankTrainer
    from gpu_runtime.trainer.policy.trainer import PolicyTrainer

    hp = cell_hparams(precision)
    t = PolicyTrainer.create(folder, hp, 0) if os.environ.get("SINGLE") else CellRankTrainer.create_rank(folder, hp, 0)
    assert next(t.model.parameters()).device.type == kind
    metrics = [t.train_step(*cell_samples(step), 4, hp) for step in (1, 2)]
    state = t.published_state()
    if rank == 0:
        torch.save({"weights": {k: v.detach().cpu() for k, v in state.items()}, "metrics": metrics}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
