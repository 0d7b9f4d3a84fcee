"""The weight-sync strategies against a stand-in for the fleet's ``Engines``: what each asks
of every engine, and which engines a distributed push the trainer cannot serve hands to the
disk load (a fallback each). The real fleet runs them in ``integration/test_weight_sync_*``
and ``integration/test_engine_fleet.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_runtime.weight_sync.distributed_push import Broadcaster, Receive
from gpu_runtime.weight_sync.shared_memory import NodeSegments
from gpu_runtime.weight_sync.strategies import DiskLoad, DistributedBroadcast, SharedMemoryLoad, WeightReceiver
from tests.engine_fixtures import make_model_folder

URLS = ["http://127.0.0.1:9/a", "http://127.0.0.1:9/b"]


class Recorder:
    """One engine's weight-load requests, as the strategy made them."""

    def __init__(self, url: str, calls: list[tuple[str, str, tuple[Any, ...]]]) -> None:
        self.url, self.calls = url, calls

    def update_weights_from_disk(self, path: str, version: int | str | None = None) -> dict[str, Any]:
        self.calls.append((self.url, "disk", (path, version)))
        return {}

    def update_weights_from_shared_memory(
        self, path: str, version: int | str, checksum: str | None = None,
    ) -> dict[str, Any]:
        self.calls.append((self.url, "shared_memory", (path, version, checksum)))
        return {}


class FakeEngines:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[Any, ...]]] = []
        self.fallbacks: list[tuple[str, str, str]] = []  # (url, version, the trainer's error)

    def load_each(self, urls: list[str], load: Callable[[WeightReceiver], object]) -> None:
        for u in urls:
            load(Recorder(u, self.calls))

    def fell_back(self, url: str, version: str, error: str | None, trainer_error: str) -> None:
        self.fallbacks.append((url, version, trainer_error))

    @property
    def receive(self) -> Receive:
        def never(*_: object, **__: object) -> None:
            raise AssertionError("no engine may join a group the trainer cannot serve")
        return never


def test_disk_load_has_every_engine_load_the_folder() -> None:
    engines = FakeEngines()
    DiskLoad().deliver(engines, URLS, "/w/v3", "3")
    assert engines.calls == [(u, "disk", ("/w/v3", "3")) for u in URLS] and engines.fallbacks == []


def test_shared_memory_publishes_once_and_every_engine_loads_the_segment(tmp_path: Path) -> None:
    checksum = make_model_folder(tmp_path / "m", seed=1, weight_version=3)
    (tmp_path / "shm").mkdir()
    strategy = SharedMemoryLoad(NodeSegments("unit", root=tmp_path / "shm"))
    engines = FakeEngines()
    strategy.deliver(engines, URLS, str(tmp_path / "m"), "3")
    (seg,) = {c[2][0] for c in engines.calls}
    assert [(u, kind, args[1:]) for u, kind, args in engines.calls] == [(u, "shared_memory", ("3", checksum)) for u in URLS]
    assert Path(seg).name.endswith("-unit-v3") and Path(seg).stat().st_size > 0
    strategy.close()
    assert not Path(seg).exists()


def test_a_distributed_push_the_trainer_cannot_serve_loads_every_engine_from_disk(tmp_path: Path) -> None:
    make_model_folder(tmp_path / "m", seed=1, weight_version=3)

    def send(*_: object) -> None:
        raise AssertionError("no group may be formed")

    strategy = DistributedBroadcast(Broadcaster("127.0.0.1", "gloo", lambda: (2, "x"), send), send_checksum=True,
                                    request_timeout_s=5.0, ranks_per_engine=1, bucket_bytes=0)
    engines = FakeEngines()
    strategy.deliver(engines, URLS, str(tmp_path / "m"), "3")
    assert strategy.result is not None and strategy.result.updated == []
    assert "the trainer holds v2" in (strategy.result.trainer_error or "")
    assert [(u, v) for u, v, _ in engines.fallbacks] == [(u, "3") for u in URLS]
    assert all("the trainer holds v2" in t for _, _, t in engines.fallbacks)
    assert engines.calls == [(u, "disk", (str(tmp_path / "m"), "3")) for u in URLS]
