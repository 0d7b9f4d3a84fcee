"""CheckpointStore on a local dir and on a real SeaweedFS (no mocks; spies wrap real stores)."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_runtime.store.checkpoint_store import (
    MANIFEST,
    CheckpointStore,
    NoUsableCheckpointError,
    RetryPolicy,
    step_name,
)
from gpu_runtime.store.s3 import S3Store
from gpu_runtime.store.object_store import ForwardingStore, LocalStore, ObjectStore
from infra.seaweedfs import SeaweedServer
from spec.events import CheckpointCorrupt, CheckpointUploadFailed
from tests.s3_fixtures import make_s3_store_fixture, own_seaweed_fixture, seaweed_fixture, store_for, wait_until  # noqa: F401

PREFIX = "run-1/checkpoints"
FAST = RetryPolicy(base_s=0.05, max_s=0.5, deadline_s=60.0)


class SpyStore(ForwardingStore):
    """A real store plus a record of puts and a gate that can hold puts matching a predicate."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.puts: list[str] = []
        self.hold: Callable[[str], bool] = lambda key: False
        self.released = threading.Event()
        self.blocked = threading.Event()

    def _gate(self, key: str) -> None:
        if self.hold(key) and not self.released.is_set():
            self.blocked.set()
            assert self.released.wait(60), f"put of {key} held for 60 s"

    def put_bytes(self, key: str, data: bytes) -> None:
        self._gate(key)
        self.inner.put_bytes(key, data)
        self.puts.append(key)

    def put_file(self, key: str, path: str | Path) -> None:
        self._gate(key)
        self.inner.put_file(key, path)
        self.puts.append(key)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    make: Callable[..., S3Store] = request.getfixturevalue("make_s3_store")
    return make("ckpt")


def write_folder(folder: Path, files: dict[str, bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return folder


def state(step: int, *, frozen: bytes = b"F" * 3000) -> dict[str, bytes]:
    """A checkpoint folder: weights/optimizer change every step, tokenizer does not."""
    return {
        "model.safetensors": hashlib.sha256(b"w%d" % step).digest() * 4000,
        "optimizer/state.safetensors": hashlib.sha256(b"o%d" % step).digest() * 3000,
        "trainer_state.json": json.dumps({"step": step}).encode(),
        "tokenizer.json": frozen,
    }


def read_folder(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def save_steps(cs: CheckpointStore, tmp_path: Path, steps: list[int]) -> None:
    for s in steps:
        h = cs.save(s, write_folder(tmp_path / f"work-{s}", state(s)), {"step": s, "policy_version": s})
        assert h.wait(60), h.error


def test_roundtrip_verifies_sha256(store: ObjectStore, tmp_path: Path) -> None:
    cs = CheckpointStore(store, PREFIX, tmp_path / "local", retry=FAST)
    work = write_folder(tmp_path / "work", state(7))
    meta = {"step": 7, "policy_version": 7, "data_cursor": {"epoch": 0, "index": 56}, "config_hash": "abc"}
    handle = cs.save(7, work, meta)
    (work / "model.safetensors").write_bytes(b"the trainer keeps going")  # the local copy is separate
    assert handle.wait(60), handle.error
    assert handle.durable and handle.error is None and handle.local_path == tmp_path / "local" / "step-000007"
    assert read_folder(handle.local_path) == state(7)

    info = cs.latest_durable()
    assert info is not None and info.step == 7 and info.meta == meta
    for rel, data in state(7).items():
        assert info.files[rel].sha256 == hashlib.sha256(data).hexdigest()
        assert info.files[rel].size == len(data) and info.files[rel].stored_in == "step-000007"
    restored = cs.restore(tmp_path / "restored")
    assert restored.step == 7 and read_folder(tmp_path / "restored") == state(7)
    assert cs.events == [] and cs.wait_for_uploads(1)
    # a second store object (another process) sees the same durable checkpoint
    other = CheckpointStore(store, PREFIX, tmp_path / "other")
    assert [i.step for i in other.list_durable()] == [7]


def test_manifest_written_last_and_required(store: ObjectStore, tmp_path: Path) -> None:
    spy = SpyStore(store)
    cs = CheckpointStore(spy, PREFIX, tmp_path / "local", retry=FAST)
    save_steps(cs, tmp_path, [1])
    manifest_2 = f"{PREFIX}/{step_name(2)}/{MANIFEST}"
    spy.hold = lambda key: key == manifest_2
    handle = cs.save(2, write_folder(tmp_path / "w2", state(2)), {"step": 2})
    assert spy.blocked.wait(60), "upload never reached the manifest"
    # every file of step 2 is uploaded, but without its manifest the checkpoint is invisible
    assert {k for k in spy.puts if "/step-000002/" in k} == {
        f"{PREFIX}/step-000002/{r}" for r in state(2) if r != "tokenizer.json"}
    assert [i.step for i in cs.list_durable()] == [1] and cs.latest_durable().step == 1
    assert not handle.done
    spy.released.set()
    assert handle.wait(60), handle.error
    assert spy.puts[-1] == manifest_2
    assert cs.latest_durable().step == 2
    # stray files without a manifest (e.g. a crashed uploader) are never picked up
    store.put_bytes(f"{PREFIX}/{step_name(9)}/model.safetensors", b"partial")
    store.put_bytes(f"{PREFIX}/{step_name(10)}/{MANIFEST}", b"{not json")
    assert cs.latest_durable().step == 2
    assert cs.restore(tmp_path / "r").step == 2


def test_unchanged_files_are_not_uploaded_again(store: ObjectStore, tmp_path: Path) -> None:
    spy = SpyStore(store)
    cs = CheckpointStore(spy, PREFIX, tmp_path / "local", retry=FAST)
    save_steps(cs, tmp_path, [1])
    spy.puts.clear()
    h2 = cs.save(2, write_folder(tmp_path / "w2", state(2)), {"step": 2})
    assert h2.wait(60), h2.error
    assert f"{PREFIX}/step-000002/tokenizer.json" not in spy.puts
    assert not any(k.endswith("tokenizer.json") for k in spy.puts)
    assert h2.skipped == ["tokenizer.json"] and len(h2.uploaded) == 3
    assert spy.puts[-1].endswith(f"step-000002/{MANIFEST}")
    info = cs.latest_durable()
    assert info is not None and info.files["tokenizer.json"].stored_in == "step-000001"
    assert info.files["model.safetensors"].stored_in == "step-000002"
    save_steps(cs, tmp_path, [3])  # references point at the folder that holds the bytes
    assert cs.latest_durable().files["tokenizer.json"].stored_in == "step-000001"
    assert cs.restore(tmp_path / "r").step == 3 and read_folder(tmp_path / "r") == state(3)


def test_sync_save_and_invalid_input(store: ObjectStore, tmp_path: Path) -> None:
    cs = CheckpointStore(store, PREFIX, tmp_path / "local", retry=FAST)
    with pytest.raises(NoUsableCheckpointError, match="no durable checkpoint"):
        cs.restore(tmp_path / "r")
    h = cs.save(3, write_folder(tmp_path / "w", state(3)), {"step": 3}, sync=True)
    assert h.done and h.durable and cs.latest_durable().step == 3
    with pytest.raises(NoUsableCheckpointError, match="step-000004"):
        cs.restore(tmp_path / "r", step=4)
    with pytest.raises(ValueError, match="meta"):
        cs.save(4, tmp_path / "w", {"bad": object()})
    with pytest.raises(FileNotFoundError, match="nope"):
        cs.save(4, tmp_path / "nope", {})
    (tmp_path / "w" / MANIFEST).write_text("{}")
    with pytest.raises(ValueError, match="reserved"):
        cs.save(4, tmp_path / "w", {})


def test_keep_last_keeps_referenced_files(store: ObjectStore, tmp_path: Path) -> None:
    cs = CheckpointStore(store, PREFIX, tmp_path / "local", keep_last=2, retry=FAST)
    save_steps(cs, tmp_path, [1, 2, 3, 4])
    assert [i.step for i in cs.list_durable()] == [3, 4]
    keys = set(store.list(PREFIX))
    # step 1 is gone except the unchanged tokenizer that steps 3 and 4 still reference
    assert {k for k in keys if "/step-000001/" in k} == {f"{PREFIX}/step-000001/tokenizer.json"}
    assert not any("/step-000002/" in k for k in keys)
    assert f"{PREFIX}/step-000003/model.safetensors" in keys
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["step-000003", "step-000004"]
    info = cs.restore(tmp_path / "r", step=3)
    assert info.step == 3 and read_folder(tmp_path / "r") == state(3)
    # when the tokenizer changes, the old copy stops being referenced and is collected
    h = cs.save(5, write_folder(tmp_path / "w5", state(5, frozen=b"new tok")), {"step": 5})
    assert h.wait(60), h.error
    h = cs.save(6, write_folder(tmp_path / "w6", state(6, frozen=b"new tok")), {"step": 6})
    assert h.wait(60), h.error
    assert not any("/step-000001/" in k for k in store.list(PREFIX))
    assert [i.step for i in cs.list_durable()] == [5, 6]


def test_corrupt_checkpoint_falls_back_and_reports(store: ObjectStore, tmp_path: Path) -> None:
    cs = CheckpointStore(store, PREFIX, tmp_path / "local", retry=FAST)
    save_steps(cs, tmp_path, [1, 2, 3])
    key = f"{PREFIX}/step-000003/model.safetensors"
    data = bytearray(store.get_bytes(key))
    data[len(data) // 2] ^= 0xFF
    store.put_bytes(key, bytes(data))
    store.delete(f"{PREFIX}/step-000002/optimizer/state.safetensors")

    info = cs.restore(tmp_path / "r")
    assert info.step == 1 and read_folder(tmp_path / "r") == state(1)
    ev3, ev2 = cs.events
    assert isinstance(ev3, CheckpointCorrupt) and isinstance(ev2, CheckpointCorrupt)
    assert [(e.step, e.file) for e in (ev3, ev2)] == [(3, "model.safetensors"), (2, "optimizer/state.safetensors")]
    assert ev3.expected == hashlib.sha256(state(3)["model.safetensors"]).hexdigest()
    assert ev3.actual == hashlib.sha256(bytes(data)).hexdigest() and ev2.actual == "missing"
    assert not (tmp_path / ".r.restoring").exists()

    # the shared (unchanged) file is corrupt too: nothing verifies -> clear error
    store.put_bytes(f"{PREFIX}/step-000001/tokenizer.json", b"garbage")
    with pytest.raises(NoUsableCheckpointError, match="step-000003, step-000002, step-000001"):
        cs.restore(tmp_path / "r2")


def test_s3_outage_during_upload_then_recovery(own_seaweed: SeaweedServer, tmp_path: Path) -> None:
    spy = SpyStore(store_for(own_seaweed, prefix="ckpt"))
    reader = CheckpointStore(store_for(own_seaweed, spy.inner.bucket, "ckpt"), PREFIX, tmp_path / "reader")
    cs = CheckpointStore(spy, PREFIX, tmp_path / "local", retry=RetryPolicy(0.1, 0.5, 120.0))
    save_steps(cs, tmp_path, [1])

    # the upload of step 2 starts, then the store goes away mid-upload
    spy.hold = lambda key: "/step-000002/" in key
    handle = cs.save(2, write_folder(tmp_path / "w2", state(2)), {"step": 2})
    assert spy.blocked.wait(60)
    own_seaweed.stop()
    spy.hold = lambda key: False
    spy.released.set()
    wait_until(lambda: handle.failures >= 3, 60, "upload retries during the outage")
    assert not handle.done and handle.last_error is not None

    # back on the same dir and port; hold step 2 to look at the store before it commits
    spy.released.clear()
    spy.blocked.clear()
    spy.hold = lambda key: "/step-000002/" in key
    own_seaweed.start()
    assert spy.blocked.wait(60), "upload did not resume after the store came back"
    assert reader.latest_durable().step == 1
    assert reader.restore(tmp_path / "r1").step == 1 and read_folder(tmp_path / "r1") == state(1)
    spy.released.set()
    assert handle.wait(60), handle.error
    assert handle.durable and handle.failures >= 3
    assert reader.latest_durable().step == 2
    assert reader.restore(tmp_path / "r2").step == 2 and read_folder(tmp_path / "r2") == state(2)


def test_upload_gives_up_after_deadline(own_seaweed: SeaweedServer, tmp_path: Path) -> None:
    s3 = store_for(own_seaweed, prefix="ckpt")
    cs = CheckpointStore(s3, PREFIX, tmp_path / "local", retry=RetryPolicy(0.05, 0.2, 1.5))
    save_steps(cs, tmp_path, [1])
    own_seaweed.stop()
    handle = cs.save(2, write_folder(tmp_path / "w2", state(2)), {"step": 2})
    assert not handle.wait(60) and handle.done
    assert handle.error is not None and "giving up" in str(handle.error) and handle.failures >= 2
    assert isinstance(cs.events[-1], CheckpointUploadFailed) and cs.events[-1].step == 2
    assert read_folder(handle.local_path) == state(2)  # the local copy survives
    own_seaweed.start()
    assert cs.latest_durable().step == 1
    save_steps(cs, tmp_path, [3])  # later checkpoints work and clean up step 2's leftovers
    assert [i.step for i in cs.list_durable()] == [1, 3]
    assert not any("/step-000002/" in k for k in s3.list(PREFIX))
