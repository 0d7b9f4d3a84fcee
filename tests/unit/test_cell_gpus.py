"""A fsdp2 cell's ranks take only the node's cell GPUs (``Placement.cell_gpus``): the Ray
instance the trainer process starts is told those GPUs, so a rank never lands on a GPU an
engine holds.

Ray does not check that a GPU id it is given exists, so the mechanism is tested here on
CPU with made-up GPU ids (1 and 3 of a 4-GPU node): Ray hands each one-GPU actor one of
them and sets the actor's ``CUDA_VISIBLE_DEVICES`` to it, which is what the rank reads
(``fsdp2.device.rank_placement``). Only the CUDA work itself needs a GPU (tests marked gpu).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray  # noqa: F401  (a dev dependency: imported, so a broken install fails loudly)

from gpu_runtime.trainer.fsdp2.ray_runtime import RayRuntime, visible_gpus
from gpu_runtime.trainer.fsdp2.device import rank_placement
from gpu_runtime.trainer.fsdp2.host import CellHost
from spec.trainer import TrainerSpec


def test_visible_gpus_indexes_an_outer_list_and_restores_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with visible_gpus((1, 3)):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the node agent was given GPUs 4-7
    with visible_gpus((0, 2)):  # torch's cuda:0 and cuda:2 there
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    with visible_gpus(()):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_ray_started_for_a_cell_hands_out_only_the_cell_gpus(monkeypatch: pytest.MonkeyPatch) -> None:

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    rt = RayRuntime(num_cpus=2, gpu_ids=(1, 3)).start()
    try:
        assert ray.cluster_resources().get("GPU") == 2.0
        assert "CUDA_VISIBLE_DEVICES" not in os.environ  # the trainer process's own is left as it was

        @ray.remote(num_cpus=1, num_gpus=1)
        class Probe:
            def where(self) -> tuple[list, str | None]:
                return ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")

        probes = [Probe.remote() for _ in range(2)]
        seen = ray.get([p.where.remote() for p in probes], timeout=120)
        assert sorted(str(ids[0]) for ids, _ in seen) == ["1", "3"]
        for ids, visible in seen:  # each rank sees its one GPU as cuda:0
            assert visible == str(ids[0])
            assert rank_placement("cuda", rank=0, ray_gpu_ids=ids, visible_devices=visible, gpu_count=1).device == \
                "cuda:0"
        for p in probes:
            ray.kill(p)
    finally:
        rt.stop()
    assert rt.alive() == []


def test_a_cuda_cell_larger_than_the_cell_gpus_is_refused_before_ray_starts(tmp_path: Path) -> None:
    host = CellHost(tmp_path, device="cuda", gpus=(0, 2))
    settings = TrainerSpec(backend="fsdp2", ranks_per_cell=4, placement="strict_pack", ray_address=None,
                                      collective_timeout_s=60.0, cells=1, cell_restart_backoff_s=5.0,
                                      cell_restart_backoff_max_s=300.0)
    with pytest.raises(ValueError, match=r"ranks_per_cell 4: .* this node gives cells 2 \(GPUs \[0, 2\]"):
        host.build(settings, tmp_path / "no-model", None, 7)
    assert host.ray is None
