"""``engines.weight_sync: distributed``: config validation, the manifest (names in
``weights_checksum`` order, dtypes and shapes from the safetensors header), and one
gloo group in this process (rank 0 and rank 1 on two threads) carrying a real model's
weights bitwise. Real engines and a real trainer: tests/integration/test_weight_sync_distributed.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from gpu_runtime.models.causal_lm import export_state_dict
from gpu_runtime.models.model_folder import weights_checksum
from gpu_runtime.proc.processes import free_port
from gpu_runtime.weight_sync.distributed import (
    GroupError,
    GroupSpec,
    WeightGroup,
    folder_manifest,
    group_backend,
    manifest_from_request,
    manifest_of,
)
from spec.engine import EngineSpec
from tests.engine_fixtures import make_model_folder, tiny_model


def test_config_allows_distributed_on_both_backends_and_names_bad_fields() -> None:
    assert EngineSpec(weight_sync="distributed").weight_sync_timeout_s == 60.0
    assert EngineSpec(weight_sync="distributed", backend="sglang").backend == "sglang"
    with pytest.raises(ValidationError, match="weight_sync"):
        EngineSpec(weight_sync="nccl")
    with pytest.raises(ValidationError, match="weight_sync_timeout_s"):
        EngineSpec(weight_sync="distributed", weight_sync_timeout_s=0)
    with pytest.raises(ValidationError, match="shared_memory needs engines.backend torch"):
        EngineSpec(weight_sync="shared_memory", backend="sglang")


def test_folder_manifest_is_the_exported_state_in_checksum_order(tmp_path: Path) -> None:
    make_model_folder(tmp_path / "m", seed=1, weight_version=1)
    model, _ = tiny_model(1)
    sd = export_state_dict(model)
    m = folder_manifest(tmp_path / "m")
    assert m == manifest_of(sd)
    assert m.names == sorted(sd) and "lm_head.weight" not in m.names  # tied: sent once, as the checksum hashes it
    assert m.nbytes == sum(t.numel() * t.element_size() for t in sd.values())
    assert manifest_from_request({**m.as_request(), "dtypes": ["torch." + d for d in m.dtypes]}) == m
    assert "bucket_bytes" not in m.as_request()  # SGLang's fields only, unless packing is asked for
    assert manifest_from_request(m.with_buckets(1024).as_request()) == m.with_buckets(1024)


def test_bad_requests_and_specs_are_refused_by_field() -> None:
    with pytest.raises(ValueError, match="names, dtypes and shapes are required"):
        manifest_from_request({"names": ["a"]})
    with pytest.raises(ValueError, match=r"names \(2\), dtypes \(1\)"):
        manifest_from_request({"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1], [2]]})
    with pytest.raises(ValueError, match="unknown dtype 'float33'"):
        manifest_from_request({"names": ["a"], "dtypes": ["float33"], "shapes": [[1]]})
    with pytest.raises(ValueError, match="backend 'mpi'"):
        GroupSpec("127.0.0.1", 1, 2, "g", "mpi")
    with pytest.raises(ValueError, match="world_size 1"):
        GroupSpec("127.0.0.1", 1, 1, "g")


@pytest.mark.parametrize("bucket_bytes", [0, 20_000])
def test_a_gloo_group_carries_a_model_bitwise_and_refuses_a_wrong_state(bucket_bytes: int) -> None:
    """Per tensor (SGLang's way) and packed in buckets (20 kB here: several tensors per
    bucket, and tensors larger than a bucket sent alone)."""
    model, _ = tiny_model(2)
    sd = export_state_dict(model)
    manifest = manifest_of(sd).with_buckets(bucket_bytes)
    buckets = manifest.buckets()
    assert [i for b in buckets for i in b] == list(range(len(manifest.names)))
    if bucket_bytes:
        assert len(buckets) < len(manifest.names) and any(len(b) > 1 for b in buckets)
        assert any(len(b) == 1 and manifest.sizes()[b[0]] > bucket_bytes for b in buckets)
    spec = GroupSpec("127.0.0.1", free_port(), 2, f"unit{bucket_bytes}", "gloo")
    got: dict = {}

    def engine() -> None:
        g = WeightGroup(spec, 1, timeout_s=30)
        try:
            got.update(g.receive(manifest))
        finally:
            g.close()

    t = threading.Thread(target=engine)
    t.start()
    g0 = WeightGroup(spec, 0, timeout_s=30)
    try:
        assert g0.send(sd, manifest) == manifest.nbytes
    finally:
        g0.close()
        t.join()
    assert weights_checksum(got) == weights_checksum(sd)
    assert all(torch.equal(got[k], sd[k]) for k in sd)
    wrong = dict(sd)
    wrong.pop(manifest.names[0])
    spec2 = GroupSpec("127.0.0.1", free_port(), 2, f"unit2-{bucket_bytes}", "gloo")
    t = threading.Thread(target=lambda: pytest.raises(GroupError, WeightGroup(spec2, 1, timeout_s=5).receive, manifest))
    t.start()
    g0 = WeightGroup(spec2, 0, timeout_s=5)
    try:
        with pytest.raises(GroupError, match="does not match the manifest"):
            g0.send(wrong, manifest)
    finally:
        g0.close()
        t.join()


def test_group_backend_is_nccl_only_between_distinct_gpus() -> None:
    assert group_backend("cpu", ["cpu", "cpu"]) == "gloo"
    assert group_backend("cpu", ["cuda:0"]) == "gloo"
    assert group_backend("cuda:0", ["cuda:1", "cuda:2"]) == "nccl"  # disaggregated
    assert group_backend("cuda:0", ["cuda:0"]) == "gloo"  # colocated: NCCL refuses two ranks on one GPU
    assert group_backend("cuda", ["cuda:0", "cuda:1"]) == "gloo"
    assert group_backend("cuda:0", ["cpu"]) == "gloo"


def test_a_push_the_trainer_cannot_serve_fails_every_engine_without_a_group(tmp_path: Path) -> None:
    """No engine is contacted (the urls do not exist) when the trainer holds another
    version or cannot be asked: the fleet loads every engine from disk instead."""
    from gpu_runtime.weight_sync.distributed_push import Broadcaster, push

    checksum = make_model_folder(tmp_path / "m", seed=1, weight_version=3)

    def never(*_: object) -> None:
        raise AssertionError("no group may be formed")

    def dead() -> tuple[int | None, str | None]:
        raise ConnectionError("trainer pid 1 died during held_weights")

    urls = ["http://127.0.0.1:9/a", "http://127.0.0.1:9/b"]
    stale = push(urls, tmp_path / "m", "3", checksum, Broadcaster("127.0.0.1", "gloo", lambda: (2, "x"), never),
                 receive=never)
    assert stale.updated == [] and set(stale.failed) == set(urls) and "the trainer holds v2" in (stale.trainer_error or "")
    gone = push(urls, tmp_path / "m", "3", checksum, Broadcaster("127.0.0.1", "gloo", dead, never), receive=never)
    assert gone.updated == [] and "trainer pid 1 died" in (gone.trainer_error or "")
