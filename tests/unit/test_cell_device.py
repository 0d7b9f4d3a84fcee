"""Where a fsdp2 cell's rank computes (``gpu_runtime.trainer.fsdp2.device``): pure logic over
what the rank's process sees, so the CUDA choices are tested here without a GPU."""

from __future__ import annotations

import pytest

from gpu_runtime.trainer.fsdp2.device import RankPlacement, cell_kind, rank_bundle, rank_placement


def test_cpu_cells_use_gloo_on_the_cpu() -> None:
    assert rank_placement("cpu", rank=3, gpu_count=8) == RankPlacement("gloo", "cpu")
    assert rank_bundle("cpu", 1.0) == {"CPU": 1.0}
    assert cell_kind("cpu") == "cpu"


def test_cuda_cells_use_nccl_and_one_gpu_per_rank() -> None:
    assert cell_kind("cuda:3") == "cuda"
    assert rank_bundle("cuda", 2.0) == {"CPU": 2.0, "GPU": 1.0}
    # Ray assigned GPU 5 and set CUDA_VISIBLE_DEVICES=5: the rank sees it as cuda:0
    assert rank_placement("cuda", rank=1, ray_gpu_ids=[5], visible_devices="5", gpu_count=1) == \
        RankPlacement("nccl", "cuda:0")
    # visible devices left alone (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES): the id is the index
    assert rank_placement("cuda", rank=0, ray_gpu_ids=["2"], gpu_count=4).device == "cuda:2"
    # a wider visible list: the assigned id's position in it
    assert rank_placement("cuda", rank=0, ray_gpu_ids=[6], visible_devices="4,6", gpu_count=2).device == "cuda:1"
    # a torchrun-style launch: LOCAL_RANK; else the rank itself (one process per GPU)
    assert rank_placement("cuda", rank=3, local_rank="1", gpu_count=2).device == "cuda:1"
    assert rank_placement("cuda", rank=1, gpu_count=2).device == "cuda:1"
    # Ray's GPU beats LOCAL_RANK (Ray decided which GPU this actor may use)
    assert rank_placement("cuda", rank=1, ray_gpu_ids=[0], visible_devices="0", local_rank="1", gpu_count=1).device == \
        "cuda:0"


@pytest.mark.parametrize("kw,why", [
    (dict(gpu_count=0), "sees no CUDA device"),
    (dict(ray_gpu_ids=[0, 1], gpu_count=2), "exactly one"),
    (dict(ray_gpu_ids=[3], visible_devices="0,1", gpu_count=2), "not among CUDA_VISIBLE_DEVICES"),
    (dict(local_rank="2", gpu_count=2), "out of range"),
    (dict(gpu_count=1), "out of range"),  # rank 1 of a cell on a one-GPU node, no Ray, no LOCAL_RANK
])
def test_a_rank_that_cannot_have_its_gpu_says_why(kw: dict, why: str) -> None:
    with pytest.raises(ValueError, match=why) as err:
        rank_placement("cuda", rank=1, **kw)
    assert "rank 1" in str(err.value)


def test_other_devices_are_refused() -> None:
    with pytest.raises(ValueError, match="cpu or cuda"):
        cell_kind("mps")
