"""S3Store against a real SeaweedFS server (no mocks)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gpu_runtime.store.s3 import S3Store
from gpu_runtime.store.object_store import StoreError
from gpu_runtime.store.uri import open_store
from infra.seaweedfs import SeaweedServer, free_port
from tests.s3_fixtures import make_s3_store_fixture, new_bucket_name, s3_store_fixture, seaweed_fixture  # noqa: F401


def test_basic_ops(s3_store: S3Store, tmp_path: Path) -> None:
    s3_store.put_bytes("a/one.txt", b"one")
    s3_store.put_bytes("a/b/two.txt", b"two")
    s3_store.put_bytes("ab/three.txt", b"three")
    assert s3_store.get_bytes("a/one.txt") == b"one"
    assert s3_store.exists("a/b/two.txt") and not s3_store.exists("a/nope")
    # folder semantics like LocalStore: "a" does not match "ab/..."
    assert s3_store.list("a") == ["a/b/two.txt", "a/one.txt"]
    assert s3_store.list("a/") == ["a/b/two.txt", "a/one.txt"]
    assert s3_store.list("a/one.txt") == ["a/one.txt"]
    assert s3_store.list("") == ["a/b/two.txt", "a/one.txt", "ab/three.txt"]
    assert s3_store.list("zzz") == []
    with pytest.raises(KeyError):
        s3_store.get_bytes("a/missing")
    with pytest.raises(KeyError):
        s3_store.get_file("a/missing", tmp_path / "x")
    s3_store.delete("a/one.txt")
    s3_store.delete("a/one.txt")  # idempotent
    assert not s3_store.exists("a/one.txt")
    s3_store.delete_prefix("a")
    assert s3_store.list("") == ["ab/three.txt"]
    assert s3_store.uri("k") == f"{s3_store.root_uri}/k" and s3_store.root_uri.endswith("/ckpt-root")


def test_list_paginates(s3_store: S3Store) -> None:
    keys = [f"many/k{i:04d}" for i in range(1105)]  # > 1000: two pages
    for k in keys:
        s3_store.put_bytes(k, b"x")
    assert s3_store.list("many") == keys
    s3_store.delete_prefix("many")  # > 1000: two delete_objects batches
    assert s3_store.list("many") == []


def test_multipart_file_roundtrip_and_verify(make_s3_store: Callable[..., S3Store], tmp_path: Path) -> None:
    store = make_s3_store("mp", multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
    data = os.urandom(12 << 20)  # 3 parts
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    store.put_file("big.bin", src)
    size, etag = store.head("big.bin") or (0, "")
    assert size == len(data) and etag.endswith("-3")  # multipart ETag, checked without re-reading
    assert store.verify_file("big.bin", src, sha, len(data))
    assert not store.verify_file("big.bin", src, sha, len(data) + 1)
    store.get_file("big.bin", tmp_path / "out" / "big.bin")
    assert (tmp_path / "out" / "big.bin").read_bytes() == data
    # a changed object no longer verifies (ETag differs -> falls back to re-read + sha256)
    store.put_bytes("big.bin", data[:-1] + bytes([data[-1] ^ 1]))
    assert not store.verify_file("big.bin", src, sha, len(data))


def test_from_uri_reads_env_and_creates_bucket(seaweed: SeaweedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    bucket = new_bucket_name()
    monkeypatch.setenv("MILESTONE_S3_ENDPOINT", seaweed.endpoint_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed.secret_key)
    store = open_store(f"s3://{bucket}/runs/r1")
    assert isinstance(store, S3Store) and store.bucket == bucket and store.prefix == "runs/r1"
    store.put_bytes("k", b"v")
    again = open_store(f"s3://{bucket}/runs/r1")  # bucket exists now: fine
    assert again.get_bytes("k") == b"v"
    again.delete_prefix("")


def test_wrong_credentials_refused(seaweed: SeaweedServer, s3_store: S3Store) -> None:
    s3_store.put_bytes("secret", b"s")
    with pytest.raises(StoreError, match="AWS_SECRET_ACCESS_KEY"):
        S3Store(s3_store.bucket, endpoint_url=seaweed.endpoint_url,
                access_key=seaweed.access_key, secret_key="wrong-secret")
    bad = S3Store(s3_store.bucket, "ckpt-root", endpoint_url=seaweed.endpoint_url,
                  access_key="nobody", secret_key="wrong-secret", create_bucket=False)
    with pytest.raises(StoreError):
        bad.get_bytes("secret")
    with pytest.raises(StoreError):
        bad.put_bytes("evil", b"x")
    assert not s3_store.exists("evil")


def test_outage_is_a_quick_store_error() -> None:
    dead = S3Store("nobucket", endpoint_url=f"http://127.0.0.1:{free_port()}", access_key="a",
                   secret_key="b", create_bucket=False)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="nobucket"):
        dead.put_bytes("k", b"v")
    assert time.monotonic() - t0 < 5.0


def test_conditional_update_and_fence_on_s3(s3_store: S3Store) -> None:
    """The fence on S3: compare-and-swap by conditional puts (concurrent updates lose
    nothing), epochs only move forward, and writes of an older epoch are refused."""
    import threading

    from gpu_runtime.store.fence import FencedStore, StaleEpoch, raise_fence, read_fence

    def bump(old: bytes | None) -> bytes:
        return str(int(old or b"0") + 1).encode()

    threads = [threading.Thread(target=lambda: [s3_store.update("runs/r/n", bump) for _ in range(10)]) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s3_store.get_bytes("runs/r/n") == b"30"
    # the server enforces the preconditions the compare-and-swap relies on
    from botocore.exceptions import ClientError

    for cond in ({"IfMatch": '"0123456789abcdef0123456789abcdef"'}, {"IfNoneMatch": "*"}):
        with pytest.raises(ClientError, match="412|PreconditionFailed"):
            s3_store._client.put_object(Bucket=s3_store.bucket, Key=s3_store._key("runs/r/n"), Body=b"x", **cond)
    assert s3_store.get_bytes("runs/r/n") == b"30"

    raise_fence(s3_store, "r", 1, "n0", from_step=1)
    old = FencedStore(s3_store, "r", 1, "n0")
    old.put_bytes("runs/r/steps/000002/rewards.json", b"epoch 1")
    raise_fence(s3_store, "r", 2, "n1", from_step=2)
    with pytest.raises(StaleEpoch):
        raise_fence(s3_store, "r", 1, "n0", from_step=1)
    with pytest.raises(StaleEpoch, match="the run is at epoch 2"):
        old.put_bytes("runs/r/steps/000002/rewards.json", b"zombie")
    with pytest.raises(StaleEpoch):
        old.delete_prefix("runs/r/steps")
    assert s3_store.get_bytes("runs/r/steps/000002/rewards.json") == b"epoch 1"
    FencedStore(s3_store, "r", 2, "n1").put_bytes("runs/r/steps/000002/rewards.json", b"epoch 2")
    assert read_fence(s3_store, "r").epoch == 2
