"""The pull path for weights (``gpu_runtime.weight_sync.http_server`` / ``http_pull``): a rollout
node fetches a version folder from the trainer node's ``WeightServer`` over real sockets,
checked tensor by tensor, and writes it as a local model folder the engines' checksum gate
accepts; a corrupted tensor, a wrong version, a missing token or a server stopped mid-transfer
leave nothing behind and say what went wrong."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from gpu_runtime.models.causal_lm import exported_tensors
from gpu_runtime.models.model_folder import WEIGHTS_FILE, load_model_folder, model_checksum, write_model_folder
from gpu_runtime.models.safetensors_file import write_safetensors
from gpu_runtime.weight_sync.http_pull import PullRefused, PullVerificationError, WeightPullError, pull_version
from gpu_runtime.weight_sync.http_server import WeightServer
from tests.engine_fixtures import free_port, make_model_folder, tiny_model, wait_for

RUN = "run-pull"
TOKEN = "s3cret-token"
Resolve = Callable[[str, int, str], Path]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module", name="source")
def source_fixture(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny model folder written by the project's writer (v1) and its checksum."""
    folder = tmp_path_factory.mktemp("trainer") / "v000001"
    return folder, make_model_folder(folder, seed=1, weight_version=1)


@pytest.fixture(name="serve")
def serve_fixture() -> Iterator[Callable[..., WeightServer]]:
    """Start a WeightServer on 127.0.0.1 (``serve(resolve, token=None)``); all stopped at teardown."""
    started: list[WeightServer] = []

    def serve(resolve: Resolve, token: str | None = None) -> WeightServer:
        server = WeightServer("127.0.0.1", resolve=resolve, token=token).start()
        started.append(server)
        return server

    yield serve
    for server in started:
        server.stop()


def _copy(source: tuple[Path, str], dst: Path) -> tuple[Path, str]:
    shutil.copytree(source[0], dst)
    return dst, source[1]


def test_pulled_folder_is_byte_identical_and_passes_the_checksum_gate(
        source: tuple[Path, str], serve: Callable[..., WeightServer], tmp_path: Path) -> None:
    folder, checksum = source
    server = serve(lambda run, version, c: folder)
    dst = tmp_path / "node" / "v000001"
    stats = pull_version(server.url, RUN, 1, checksum, dst)
    assert _files(dst) == _files(folder)
    assert stats.files == len(_files(folder)) and stats.bytes == sum(len(b) for b in _files(folder).values())
    model, _, meta = load_model_folder(dst)  # what an engine does, then its gate: the loaded weights' checksum
    assert meta == {"weight_version": 1, "checksum": checksum}
    assert model_checksum(model) == checksum
    assert sorted(p.name for p in dst.parent.iterdir()) == ["v000001"]  # no temp folder left
    pull_version(server.url, RUN, 1, checksum, dst)  # again over it: replaced whole
    assert _files(dst) == _files(folder)


def test_a_flipped_byte_in_one_tensor_fails_naming_it_and_leaves_no_folder(
        source: tuple[Path, str], serve: Callable[..., WeightServer], tmp_path: Path) -> None:
    folder, checksum = _copy(source, tmp_path / "trainer" / "v000001")
    server = serve(lambda run, version, c: folder)
    url = f"{server.url}/v1/weights/{RUN}/1/manifest?checksum={checksum}"
    manifest = json.loads(urllib.request.urlopen(url, timeout=60).read())  # computed and cached: bytes as written
    entry = next(f for f in manifest["files"] if f["path"] == WEIGHTS_FILE)
    victim = next(t for t in entry["tensors"] if t["name"] == "model.layers.1.mlp.up_proj.weight")
    with open(folder / WEIGHTS_FILE, "r+b") as f:  # the served file changes under the cached manifest
        f.seek(victim["start"] + 5)
        byte = f.read(1)
        f.seek(victim["start"] + 5)
        f.write(bytes([byte[0] ^ 0x01]))
    dst = tmp_path / "node" / "v000001"
    with pytest.raises(PullVerificationError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight of "
                                                    r"model\.safetensors: sha256 .* differs"):
        pull_version(server.url, RUN, 1, checksum, dst)
    assert not dst.exists()
    assert list(dst.parent.iterdir()) == []


def test_a_wrong_version_or_checksum_is_a_409_naming_it(
        source: tuple[Path, str], serve: Callable[..., WeightServer], tmp_path: Path) -> None:
    folder, checksum = source

    def resolve(run: str, version: int, c: str) -> Path:  # the trainer's latest export, whatever was asked
        if run != RUN:
            raise FileNotFoundError(f"no run {run} on this node")
        return folder

    server = serve(resolve)
    dst = tmp_path / "node" / "v"
    with pytest.raises(PullRefused, match=r"HTTP 409: .*checksum deadbeef") as err:
        pull_version(server.url, RUN, 1, "deadbeef", dst)
    assert err.value.status == 409
    with pytest.raises(PullRefused, match=r"HTTP 409: .*holds weight_version 1 .*asked for v2") as err:
        pull_version(server.url, RUN, 2, checksum, dst)
    assert err.value.status == 409
    with pytest.raises(PullRefused, match="HTTP 404: .*no run other-run on this node") as err:
        pull_version(server.url, "other-run", 1, checksum, dst)
    assert err.value.status == 404
    with pytest.raises(urllib.error.HTTPError) as http_err:  # what any client sees: JSON naming the checksum
        urllib.request.urlopen(f"{server.url}/v1/weights/{RUN}/1/manifest?checksum=deadbeef", timeout=60)
    assert http_err.value.code == 409
    assert "deadbeef" in json.loads(http_err.value.read())["error"]
    assert not dst.parent.exists() or list(dst.parent.iterdir()) == []


def test_a_request_without_the_token_is_a_401(
        source: tuple[Path, str], serve: Callable[..., WeightServer], tmp_path: Path) -> None:
    folder, checksum = source
    server = serve(lambda run, version, c: folder, token=TOKEN)
    for token in (None, "wrong"):
        with pytest.raises(PullRefused, match="HTTP 401") as err:
            pull_version(server.url, RUN, 1, checksum, tmp_path / "v", token=token)
        assert err.value.status == 401
    with pytest.raises(urllib.error.HTTPError) as http_err:  # the files too, not only the manifest
        urllib.request.urlopen(f"{server.url}/v1/weights/{RUN}/1/files/{WEIGHTS_FILE}?checksum={checksum}",
                               timeout=60)
    assert http_err.value.code == 401
    pull_version(server.url, RUN, 1, checksum, tmp_path / "v", token=TOKEN)
    assert _files(tmp_path / "v") == _files(folder)
    with pytest.raises(ValueError, match="reachable from the network"):  # the engines' rule: no token, loopback only
        WeightServer("0.0.0.0", resolve=lambda run, version, c: folder)


def test_concurrent_pullers_of_one_version_trigger_one_resolve(
        source: tuple[Path, str], serve: Callable[..., WeightServer], tmp_path: Path) -> None:
    folder, checksum = source
    calls: list[tuple[str, int, str]] = []
    release = threading.Event()

    def resolve(run: str, version: int, c: str) -> Path:  # an export on demand: slow, once
        calls.append((run, version, c))
        if not release.wait(timeout=120):
            raise TimeoutError("the test never released the export")
        return folder

    server = serve(resolve)
    results: dict[int, object] = {}

    def pull(i: int) -> None:
        try:
            results[i] = pull_version(server.url, RUN, 1, checksum, tmp_path / f"node{i}" / "v000001")
        except Exception as err:  # noqa: BLE001 - asserted below
            results[i] = err

    pullers = [threading.Thread(target=pull, args=(i,)) for i in range(3)]
    for t in pullers:
        t.start()
    try:
        wait_for(lambda: server.waiting_for_versions == 3, 60, "3 pullers waiting on one version")
        assert len(calls) == 1
    finally:
        release.set()
        for t in pullers:
            t.join(timeout=120)
    assert calls == [(RUN, 1, checksum)]
    for i in range(3):
        assert not isinstance(results[i], Exception), results[i]
        assert _files(tmp_path / f"node{i}" / "v000001") == _files(folder)


def test_a_lora_adapter_folder_arrives_in_its_place(
        source: tuple[Path, str], serve: Callable[..., WeightServer], tmp_path: Path) -> None:
    folder, checksum = _copy(source, tmp_path / "trainer" / "v000001")
    (folder / "adapter").mkdir()
    g = torch.Generator().manual_seed(3)
    write_safetensors(folder / "adapter" / "adapter_model.safetensors", {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(8, 64, generator=g),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 8),
    }, metadata={"format": "pt"})
    (folder / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
    server = serve(lambda run, version, c: folder)
    dst = tmp_path / "node" / "v000001"
    pull_version(server.url, RUN, 1, checksum, dst)
    assert _files(dst) == _files(folder)
    assert (dst / "adapter" / "adapter_model.safetensors").is_file()
    manifest = json.loads(urllib.request.urlopen(
        f"{server.url}/v1/weights/{RUN}/1/manifest?checksum={checksum}", timeout=60).read())
    adapter = next(f for f in manifest["files"] if f["path"] == "adapter/adapter_model.safetensors")
    assert [t["name"].rsplit(".", 2)[-2] for t in adapter["tensors"]] == ["lora_A", "lora_B"]  # checked per tensor


class _StallingProxy:
    """A TCP proxy in front of the server that forwards the server's first ``stall_after``
    bytes, then stops reading until ``release`` (so the transfer is caught mid-file)."""

    def __init__(self, upstream: tuple[str, int], stall_after: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.upstream, self.stall_after = upstream, stall_after
        self.stalled, self.release = threading.Event(), threading.Event()
        self.socks: list[socket.socket] = [self.listener]
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        up = socket.socket()
        up.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # little buffered ahead of the stall
        up.connect(self.upstream)
        self.socks += [client, up]
        threading.Thread(target=self._pump, args=(client, up, False), daemon=True).start()
        self._pump(up, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, stall: bool) -> None:
        sent = 0
        try:
            while data := src.recv(1 << 16):
                if stall and sent >= self.stall_after and not self.stalled.is_set():
                    self.stalled.set()
                    self.release.wait(timeout=120)
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        self.release.set()
        for s in self.socks:
            s.close()


def test_the_server_stopped_mid_transfer_is_a_clear_error_and_no_folder(
        serve: Callable[..., WeightServer], tmp_path: Path) -> None:
    model, tok = tiny_model(1)
    weights = {**{k: v.contiguous() for k, v in exported_tensors(model).items()},
               "model.extra.weight": torch.randn(16 << 20)}  # 64 MB: far more than the sockets buffer
    folder = tmp_path / "trainer" / "v000001"
    checksum = write_model_folder(model.config, None, tok, folder, weight_version=1, weights=weights)
    server = serve(lambda run, version, c: folder)
    proxy = _StallingProxy(("127.0.0.1", server.port), stall_after=8 << 20)
    dst = tmp_path / "node" / "v000001"
    box: dict[str, BaseException] = {}

    def pull() -> None:
        try:
            pull_version(proxy.url, RUN, 1, checksum, dst, timeout_s=120)
        except BaseException as err:  # noqa: BLE001 - asserted below
            box["err"] = err

    t = threading.Thread(target=pull)
    t.start()
    try:
        assert proxy.stalled.wait(timeout=120), "the transfer never reached the proxy's stall point"
        server.stop()
        proxy.release.set()
        t.join(timeout=120)
    finally:
        proxy.close()
        t.join(timeout=120)
    err = box.get("err")
    assert isinstance(err, WeightPullError), err
    assert proxy.url in str(err) and "model.safetensors: the connection closed after" in str(err)
    assert not dst.exists() and list(dst.parent.iterdir()) == []


def test_an_unreachable_server_names_its_url(source: tuple[Path, str], tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(WeightPullError, match=f"from {url}: ConnectionRefusedError"):
        pull_version(url, RUN, 1, source[1], tmp_path / "v", timeout_s=30)
    assert list(tmp_path.iterdir()) == []
