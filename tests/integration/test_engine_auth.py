"""Engine and router bearer tokens, against a real torch engine and a real sglang-router.

The token travels in the environment (``MILESTONE_ENGINE_TOKEN``), never on a command
line: each test also reads ``/proc/<pid>/cmdline``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpu_runtime.engine.auth import ENGINE_TOKEN_ENV, authorized, is_loopback
from gpu_runtime.engine.backends import TorchEngineBackend
from gpu_runtime.engine.client import EngineClient, EngineError
from gpu_runtime.engine.fleet import EngineFleet
from gpu_runtime.engine.router import RouterProcess
from tests.engine_fixtures import REPO, free_port, model_dirs_fixture, stop_pid, wait_for  # noqa: F401

TOKEN = "engine-token-5d1e9b37c2"
BODY = {"input_ids": [[1, 5, 6, 7]], "sampling_params": {"max_new_tokens": 4, "sampling_seed": 3}}


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def start_engine(model: Path, port: int, log: Path, env: dict[str, str], host: str = "127.0.0.1") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "gpu_runtime.engine.server", "--model-path", str(model), "--port", str(port),
           "--host", host, "--threads", "1", "--parent-pid", str(os.getpid())]
    with open(log, "ab") as logf:
        return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=logf, start_new_session=True,
                                env={**os.environ, **env})


@pytest.fixture(scope="module")
def engine(model_dirs, tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen]]:
    """One engine holding the token, for the whole module; stopped by pid."""
    port = free_port()
    proc = start_engine(model_dirs["v1"], port, tmp_path_factory.mktemp("engine") / "engine.log", {ENGINE_TOKEN_ENV: TOKEN})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: EngineClient(url, timeout_s=5).health(), 120, "engine /health")  # open without a token
        yield url, proc
    finally:
        stop_pid(proc)


def test_engine_answers_401_without_the_token_and_200_with_it(engine) -> None:
    url, proc = engine
    assert TOKEN not in cmdline(proc.pid)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        r = httpx.post(url + "/generate", json=BODY, headers=headers, timeout=30)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", headers
        assert httpx.get(url + "/get_model_info", headers=headers, timeout=30).status_code == 401
    r = httpx.post(url + "/generate", json=BODY, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert r.status_code == 200 and len(r.json()[0]["output_ids"]) > 0
    with EngineClient(url, timeout_s=60, token=TOKEN) as c:
        assert c.generate(BODY["input_ids"], BODY["sampling_params"])[0]["output_ids"] == r.json()[0]["output_ids"]
    with EngineClient(url, timeout_s=60, token="wrong") as c, pytest.raises(EngineError) as err:
        c.model_info()
    assert err.value.status == 401


def test_client_takes_the_token_from_the_environment(engine, monkeypatch) -> None:
    url, _ = engine
    monkeypatch.setenv(ENGINE_TOKEN_ENV, TOKEN)
    with EngineClient(url, timeout_s=60) as c:
        assert c.weights_checksum()[1] == "1"


def test_router_requires_the_token_and_passes_it_to_engines(engine, tmp_path) -> None:
    url, _ = engine
    router = RouterProcess(free_port(), [], log_path=tmp_path / "router.log", token=TOKEN)
    try:
        router.start()
        assert router.pid is not None and TOKEN not in cmdline(router.pid)
        router.add_worker(url)
        assert httpx.post(router.url + "/generate", json=BODY, timeout=30).status_code == 401
        assert httpx.get(router.url + "/workers", timeout=30).status_code == 401
        with EngineClient(router.url, timeout_s=60, token=TOKEN) as c:
            out = wait_for(lambda: _try_generate(c), 60, "a generation through the router")
        assert len(out[0]["output_ids"]) > 0
    finally:
        router.stop()
    assert TOKEN not in (tmp_path / "router.log").read_text(errors="replace")


def _try_generate(c: EngineClient) -> list | None:
    try:
        return c.generate(BODY["input_ids"], BODY["sampling_params"])
    except EngineError as err:  # 503 until the router's first health check passes
        if err.status == 401:
            raise
        return None


def test_exposed_without_a_token_is_refused(model_dirs, tmp_path, monkeypatch) -> None:
    env = {k: v for k, v in os.environ.items() if k != ENGINE_TOKEN_ENV}
    out = subprocess.run(
        [sys.executable, "-m", "gpu_runtime.engine.server", "--model-path", str(model_dirs["v1"]),
         "--port", str(free_port()), "--host", "0.0.0.0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2 and ENGINE_TOKEN_ENV in out.stderr and "0.0.0.0" in out.stderr
    monkeypatch.delenv(ENGINE_TOKEN_ENV, raising=False)
    with pytest.raises(ValueError, match=f"router host '0.0.0.0' is reachable from the network: set {ENGINE_TOKEN_ENV}"):
        RouterProcess(free_port(), host="0.0.0.0")
    with pytest.raises(ValueError, match=f"engine host '10.1.2.3' .* {ENGINE_TOKEN_ENV}"):
        EngineFleet(TorchEngineBackend(), 1, model_dirs["v1"], free_port(), tmp_path, host="10.1.2.3")
    RouterProcess(free_port(), host="0.0.0.0", token=TOKEN)  # with a token it may bind anywhere (not started)


def test_loopback_and_header_rules() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.0.0.5", "::", "node-1.lan"))
    assert authorized(f"Bearer {TOKEN}", TOKEN) and authorized(f"bearer {TOKEN}", TOKEN)
    assert not any(authorized(h, TOKEN) for h in (None, "", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN}x"))
