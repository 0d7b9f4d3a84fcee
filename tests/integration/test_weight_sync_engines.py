"""``engines.weight_sync: shared_memory`` across real processes: this process publishes
a version into /dev/shm, real torch engine subprocesses map it and load it, a corrupt or
mis-versioned segment is refused (HTTP 400, the engine keeps serving its weights), and a
fleet pushes a version that way to two engines with the same checksum gate as from disk."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_runtime.engine.backends import TorchEngineBackend
from gpu_runtime.engine.client import EngineError
from gpu_runtime.engine.fleet import EngineFleet
from gpu_runtime.engine.fleet_types import HealthConfig
from gpu_runtime.models.model_folder import load_model_folder
from gpu_runtime.models.causal_lm import export_state_dict
from gpu_runtime.weight_sync import shared_memory as shm
from tests.engine_fixtures import free_port_block, model_dirs_fixture, procs_fixture, started_engine  # noqa: F401

HEALTH = HealthConfig(interval_s=1.0, timeout_s=5.0, first_wait_s=120.0, failure_threshold=2)
PROMPTS = [[1, 5, 6, 7], [1, 9]]
SP = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 5}


def test_engine_loads_a_segment_and_refuses_bad_ones(model_dirs, procs, tmp_path: Path) -> None:
    c = started_engine(procs, model_dirs["v1"], tmp_path / "engine.log", timeout_s=60, up_within_s=120)
    assert c.weights_checksum() == (model_dirs["c1"], "1")
    v2_model, _, _ = load_model_folder(model_dirs["v2"])
    seg = shm.publish(export_state_dict(v2_model), 2, tag="itest", root=tmp_path)
    try:
        c.update_weights_from_shared_memory(str(seg.path), 2, seg.checksum)
        assert c.weights_checksum() == (model_dirs["c2"], "2")
        # the same tokens as an engine that loaded v2 from disk
        ref = started_engine(procs, model_dirs["v2"], tmp_path / "ref.log", timeout_s=60, up_within_s=120,
                             what="reference engine up")
        assert [r["output_ids"] for r in c.generate(PROMPTS, SP)] == [r["output_ids"] for r in ref.generate(PROMPTS, SP)]
        # a segment of another version than asked for, and a corrupted one: refused, weights kept
        v1_model, _, _ = load_model_folder(model_dirs["v1"])
        seg3 = shm.publish(export_state_dict(v1_model), 3, tag="itest", root=tmp_path)
        with pytest.raises(EngineError, match="holds version 3, asked for 4") as err:
            c.update_weights_from_shared_memory(str(seg3.path), 4)
        assert err.value.status == 400
        raw = bytearray(seg3.path.read_bytes())
        raw[-9] ^= 0x01
        seg3.path.write_bytes(bytes(raw))
        with pytest.raises(EngineError, match="its bytes hash to"):
            c.update_weights_from_shared_memory(str(seg3.path), 3)
        assert c.weights_checksum() == (model_dirs["c2"], "2")
    finally:
        shm.prune(tmp_path, "itest", keep=set())


def test_fleet_pushes_through_shared_memory(model_dirs, tmp_path: Path) -> None:
    fleet = EngineFleet(TorchEngineBackend(threads=1), 2, model_dirs["v1"], free_port_block(2), tmp_path / "logs",
                        health=HEALTH, weight_version=1)
    try:
        fleet.start()
        out = fleet.update_weights(model_dirs["v2"], 2, "shared_memory")
        assert out == {0: model_dirs["c2"], 1: model_dirs["c2"]}
        assert all(s.weight_version == 2 and s.checksum == model_dirs["c2"] for s in fleet.snapshot())
        segs = list(fleet.weights.shared_memory.segments.root.glob(f"milestone-weights-{fleet.weights.shared_memory.segments.tag}-v*"))
        assert [p.name.rsplit("-v", 1)[1] for p in segs] == ["2"]
        for s in fleet.snapshot():  # the engines loaded it from the segment, not the folder
            assert "updated weights from shared memory" in (tmp_path / "logs" / f"engine-{s.slot}.log").read_text()
    finally:
        fleet.stop()
    assert not list(fleet.weights.shared_memory.segments.root.glob(f"milestone-weights-{fleet.weights.shared_memory.segments.tag}-v*"))
