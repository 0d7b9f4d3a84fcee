"""``LocalWeights.folder`` (a node's ``local_weights``): a version the node's own trainer exported is hard-linked
(no copy), anything else comes from the store; the version and checksum decide."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpu_runtime.models.model_folder import META_FILE, WEIGHTS_FILE
from gpu_runtime.node.runtime import NodeRuntime
from gpu_runtime.trainer.work_dir import weights_folder

RUN = "run-a"
KEY = f"runs/{RUN}/weights/v000003"


def _folder(path: Path, version: int, checksum: str, weights: bytes) -> None:
    (path / "adapter").mkdir(parents=True)
    (path / WEIGHTS_FILE).write_bytes(weights)
    (path / "adapter" / "adapter_config.json").write_text("{}")
    (path / META_FILE).write_text(json.dumps({"weight_version": version, "checksum": checksum}))


@pytest.fixture
def node(tmp_path: Path) -> tuple[NodeRuntime, str]:
    rt = NodeRuntime("n0", "b0", tmp_path / "node")  # the trainer process is not started
    store = tmp_path / "store"
    _folder(store / KEY, 3, "sum-3", b"from the store")
    return rt, f"file://{store}"


def test_the_trainers_export_is_linked_not_copied(node: tuple[NodeRuntime, str]) -> None:
    rt, uri = node
    export = weights_folder(rt.trainer.work_dir, RUN, 3)
    _folder(export, 3, "sum-3", b"exported by the trainer")
    got = rt.local_weights.folder(uri, RUN, 3, "sum-3")
    assert (got / WEIGHTS_FILE).read_bytes() == b"exported by the trainer"
    assert (got / WEIGHTS_FILE).stat().st_ino == (export / WEIGHTS_FILE).stat().st_ino
    assert (got / "adapter" / "adapter_config.json").exists()  # nested files keep their place
    export.joinpath(WEIGHTS_FILE).unlink()  # the trainer prunes its export: the node's folder stays whole
    assert (got / WEIGHTS_FILE).read_bytes() == b"exported by the trainer"


@pytest.mark.parametrize("meta", [(3, "other-sum"), (2, "sum-3")], ids=["checksum differs", "version differs"])
def test_another_export_is_downloaded(node: tuple[NodeRuntime, str], meta: tuple[int, str]) -> None:
    rt, uri = node
    _folder(weights_folder(rt.trainer.work_dir, RUN, 3), *meta, b"exported by the trainer")
    got = rt.local_weights.folder(uri, RUN, 3, "sum-3")
    assert (got / WEIGHTS_FILE).read_bytes() == b"from the store"
    assert not got.with_name(got.name + ".download").exists()


def test_no_export_or_no_checksum_downloads(node: tuple[NodeRuntime, str]) -> None:
    rt, uri = node
    assert (rt.local_weights.folder(uri, RUN, 3, "sum-3") / WEIGHTS_FILE).read_bytes() == b"from the store"
    _folder(weights_folder(rt.trainer.work_dir, RUN, 4), 4, "sum-4", b"exported by the trainer")
    key4 = KEY.replace("v000003", "v000004")
    _folder(Path(uri.removeprefix("file://")) / key4, 4, "sum-4", b"v4 from the store")
    assert (rt.local_weights.folder(uri, RUN, 4) / WEIGHTS_FILE).read_bytes() == b"v4 from the store"


def test_a_version_the_store_does_not_hold_is_exported_again(node: tuple[NodeRuntime, str]) -> None:
    """Only checkpoint versions are stored: any other comes from this node's trainer, which
    exports it again (restore + replay) when its export is gone, and is then linked."""
    rt, uri = node
    export = weights_folder(rt.trainer.work_dir, RUN, 5)
    asked: list[int] = []

    def export_again() -> None:
        asked.append(5)
        _folder(export, 5, "sum-5", b"exported again")

    got = rt.local_weights.folder(uri, RUN, 5, "sum-5", export=export_again)
    assert asked == [5] and (got / WEIGHTS_FILE).read_bytes() == b"exported again"
    assert (got / WEIGHTS_FILE).stat().st_ino == (export / WEIGHTS_FILE).stat().st_ino
    with pytest.raises(FileNotFoundError, match="none in the store"):  # nothing can give v6
        rt.local_weights.folder(uri, RUN, 6, "sum-6")
    with pytest.raises(RuntimeError, match="does not hold it"):  # the export is another version
        rt.local_weights.folder(uri, RUN, 7, "sum-7", export=lambda: None)


def test_a_broadcast_version_is_pulled_only_when_materialized(tmp_path: Path) -> None:
    """A rollout node's engines got v2 from the trainer's group: ``expect`` writes nothing, the
    newest folder on disk stays the one engines start from, and ``materialize`` pulls v2 from the
    trainer node's weight server (once); a folder nobody expected is left as it is."""
    from gpu_runtime.node.local_weights import LocalWeights
    from gpu_runtime.trainer.work_dir import engine_weights_folder
    from gpu_runtime.weight_sync.http_server import WeightServer
    from tests.engine_fixtures import make_model_folder

    served = tmp_path / "trainer-node" / "v000002"
    checksum = make_model_folder(served, seed=2, weight_version=2)
    server = WeightServer("127.0.0.1", resolve=lambda run, version, c: served).start()
    try:
        weights = LocalWeights(tmp_path / "rollout-node" / "trainer")
        assert weights.newest(RUN) is None
        v0 = engine_weights_folder(weights.trainer_dir, RUN, 0)
        make_model_folder(v0, seed=0, weight_version=0)
        assert weights.newest(RUN) == (v0, 0)
        folder = weights.expect(server.url, RUN, 2, checksum)
        assert not folder.exists() and weights.newest(RUN) == (v0, 0)  # nothing written
        assert weights.materialize(folder) == folder
        assert json.loads((folder / META_FILE).read_text())["checksum"] == checksum
        assert weights.newest(RUN) == (folder, 2)
        server.stop()  # a second materialize pulls nothing
        assert weights.materialize(folder) == folder
        other = engine_weights_folder(weights.trainer_dir, RUN, 7)
        assert weights.materialize(other) == other and not other.exists()
    finally:
        server.stop()
