"""SeaweedFS fixtures: one real server per test session, a fresh bucket per test.

Import into a test module explicitly::

    from tests.s3_fixtures import make_s3_store_fixture, s3_store_fixture, seaweed_fixture  # noqa: F401

(each fixture function is named ``<fixture>_fixture`` and registered under ``<fixture>``, so a test's
parameter of that name does not shadow an import)
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.stack import wait_for

from gpu_runtime.store.s3 import S3Store
from infra.seaweedfs import SeaweedServer

log = logging.getLogger(__name__)

ACCESS_KEY = "MSTESTAKID4B8E2D6A"  # distinctive: the secret-grep tests search for them
SECRET_KEY = "ms-test-secret-91c3f0577d2a"


def wait_until(cond: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Poll ``cond`` every 20 ms until true; fail the test after ``timeout`` seconds."""
    try:
        wait_for(cond, timeout, interval_s=0.02, what=what)
    except TimeoutError as err:
        pytest.fail(str(err))


def new_bucket_name() -> str:
    return f"t-{uuid.uuid4().hex[:16]}"


def store_for(server: SeaweedServer, bucket: str | None = None, prefix: str = "", **kw: object) -> S3Store:
    return S3Store(
        bucket or new_bucket_name(), prefix, endpoint_url=server.endpoint_url,
        access_key=server.access_key, secret_key=server.secret_key, **kw,
    )


@pytest.fixture(scope="session", name="seaweed")
def seaweed_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """A session-wide SeaweedFS on free ports; stopped by pid at the end."""
    server = SeaweedServer(tmp_path_factory.mktemp("seaweedfs"), 0, ACCESS_KEY, SECRET_KEY)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(name="make_s3_store")
def make_s3_store_fixture(seaweed: SeaweedServer) -> Iterator[Callable[..., S3Store]]:
    """Factory for S3Stores on fresh buckets of the session server; emptied afterwards."""
    made: list[S3Store] = []

    def make(prefix: str = "", bucket: str | None = None, **kw: object) -> S3Store:
        store = store_for(seaweed, bucket, prefix, **kw)
        made.append(store)
        return store

    yield make
    for store in made:
        try:
            if seaweed.is_running():
                store.delete_prefix("")
        except Exception as e:  # noqa: BLE001 - cleanup must not mask the test result
            log.warning("cleanup of %s failed: %s", store.root_uri, e)


@pytest.fixture(name="s3_store")
def s3_store_fixture(make_s3_store: Callable[..., S3Store]) -> S3Store:
    return make_s3_store("ckpt-root")


@pytest.fixture(name="own_seaweed")
def own_seaweed_fixture(tmp_path: Path) -> Iterator[SeaweedServer]:
    """A private SeaweedFS for tests that stop and restart it (outage tests)."""
    server = SeaweedServer(tmp_path / "seaweedfs", 0, ACCESS_KEY, SECRET_KEY)
    server.start()
    try:
        yield server
    finally:
        server.stop()
