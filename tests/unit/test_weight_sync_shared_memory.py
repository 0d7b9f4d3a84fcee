"""The shared-memory weight segment (``gpu_runtime.weight_sync.shared_memory``) in one
process: round trip, refusals and pruning. Across real processes: the integration test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpu_runtime.models.causal_lm import export_state_dict
from gpu_runtime.models.model_folder import model_checksum, save_model_folder, weights_checksum
from gpu_runtime.weight_sync import shared_memory as shm
from tests.engine_fixtures import tiny_model


@pytest.fixture(scope="module")
def models():
    return tiny_model(1), tiny_model(2)


def test_round_trip_is_bitwise_and_version_stamped(models, tmp_path: Path) -> None:
    (m1, _), (m2, _) = models
    seg = shm.publish(export_state_dict(m2), 7, tag="t", root=tmp_path)
    assert seg.path == tmp_path / "milestone-weights-t-v7" and seg.checksum == model_checksum(m2)
    target, _ = tiny_model(1)
    assert model_checksum(target) != seg.checksum
    got = shm.load_into(target, seg.path, version=7, checksum=seg.checksum)
    assert got.version == "7" and model_checksum(target) == model_checksum(m2)
    for (n, a), b in zip(target.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), n
    # tied embeddings stay tied after a load (lm_head is not in the segment)
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()


def test_a_segment_of_another_version_is_refused(models, tmp_path: Path) -> None:
    (m1, _), (m2, _) = models
    seg = shm.publish(export_state_dict(m2), 3, tag="t", root=tmp_path)
    target, _ = tiny_model(1)
    before = model_checksum(target)
    with pytest.raises(shm.SegmentRefused, match="holds version 3, asked for 4"):
        shm.load_into(target, seg.path, version=4)
    with pytest.raises(shm.SegmentRefused, match="not the expected"):
        shm.load_into(target, seg.path, version=3, checksum="0" * 64)
    assert model_checksum(target) == before


def test_a_corrupted_byte_is_refused_and_the_model_keeps_its_weights(models, tmp_path: Path) -> None:
    (_, _), (m2, _) = models
    seg = shm.publish(export_state_dict(m2), 1, tag="t", root=tmp_path)
    raw = bytearray(seg.path.read_bytes())
    raw[-5] ^= 0x40  # inside the last tensor's bytes
    seg.path.write_bytes(bytes(raw))
    target, _ = tiny_model(1)
    before = model_checksum(target)
    with pytest.raises(shm.SegmentRefused, match="its bytes hash to"):
        shm.load_into(target, seg.path, version=1)
    assert model_checksum(target) == before


def test_missing_truncated_and_foreign_files_are_refused(models, tmp_path: Path) -> None:
    (_, _), (m2, _) = models
    target, _ = tiny_model(1)
    with pytest.raises(shm.SegmentRefused, match="no weight segment"):
        shm.load_into(target, tmp_path / "nope")
    (tmp_path / "foreign").write_bytes(b"not a segment at all")
    with pytest.raises(shm.SegmentRefused, match="bad magic"):
        shm.load_into(target, tmp_path / "foreign")
    seg = shm.publish(export_state_dict(m2), 1, tag="t", root=tmp_path)
    seg.path.write_bytes(seg.path.read_bytes()[:-100])
    with pytest.raises(shm.SegmentRefused, match="truncated"):
        shm.load_into(target, seg.path)


def test_publish_folder_uses_the_folder_checksum_and_node_segments_keep_the_newest(models, tmp_path: Path) -> None:
    (m1, tok), (m2, _) = models
    c1 = save_model_folder(m1, tok, tmp_path / "v1", weight_version=1)
    c2 = save_model_folder(m2, tok, tmp_path / "v2", weight_version=2)
    segs = shm.NodeSegments("fleet1", root=tmp_path / "shm")
    assert segs.tag.startswith(f"pid{os.getpid()}-")
    (tmp_path / "shm").mkdir()
    other = shm.publish(export_state_dict(m1), 1, tag="fleet2", root=tmp_path / "shm")  # another fleet's: kept
    s1 = segs.publish_folder(tmp_path / "v1", 1)
    assert s1.checksum == c1 and s1.path.exists()
    s2 = segs.publish_folder(tmp_path / "v2", 2)
    assert s2.checksum == c2 and s2.path.exists() and not s1.path.exists()
    segs.close()
    assert not s2.path.exists() and other.path.exists()


def test_tags_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="letters, digits"):
        shm.segment_path(tmp_path, "../x", 1)


def test_checksum_matches_the_store_path(models) -> None:
    """The segment's checksum is the one the trainer reports for the store path."""
    (_, _), (m2, _) = models
    assert weights_checksum(export_state_dict(m2)) == model_checksum(m2)


def test_config_refuses_shared_memory_for_sglang_engines() -> None:
    from pydantic import ValidationError

    from spec.engine import EngineSpec

    assert EngineSpec().weight_sync == "store"
    assert EngineSpec(weight_sync="shared_memory").weight_sync == "shared_memory"
    with pytest.raises(ValidationError, match="weight_sync shared_memory needs engines.backend torch"):
        EngineSpec(backend="sglang", weight_sync="shared_memory")


def test_orphans_of_a_dead_publisher_are_pruned_and_live_ones_kept(models, tmp_path: Path) -> None:
    (m1, _), _ = models
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # exited and reaped: its pid is gone
    orphan = shm.publish(export_state_dict(m1), 1, tag=f"pid{dead_pid}-fleet9", root=tmp_path)
    live = shm.publish(export_state_dict(m1), 1, tag=f"pid{os.getpid()}-fleet9", root=tmp_path)
    other = shm.publish(export_state_dict(m1), 1, tag="bench", root=tmp_path)  # not a node's: never touched
    assert shm.prune_orphans(tmp_path) == [orphan.path]
    assert not orphan.path.exists() and live.path.exists() and other.path.exists()


def test_a_segment_that_does_not_fit_is_refused_with_the_sizes(models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (m1, _), _ = models
    real = os.statvfs

    class Small:
        def __init__(self, st: os.statvfs_result) -> None:
            self.f_frsize, self.f_bavail = st.f_frsize, 1

    monkeypatch.setattr(shm.os, "statvfs", lambda p: Small(real(p)))
    with pytest.raises(OSError, match="MiB free, a weight segment of version 1 needs"):
        shm.publish(export_state_dict(m1), 1, tag="t", root=tmp_path)
    assert not list(tmp_path.iterdir())
