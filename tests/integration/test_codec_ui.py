"""The dev server's UI is pointed at the codec server (``server_command(codec_endpoint=)``,
used by ``make up`` when a payload key is set): its settings API reports the endpoint
the browser will call."""

from __future__ import annotations

from pathlib import Path

import httpx

from gpu_runtime.proc.processes import free_port, spawn, stop_pid
from infra.temporal_server import server_command, wait_for_port
from tests.stack import wait_for

CODEC = "http://127.0.0.1:8234"


def test_ui_settings_name_the_codec_endpoint(tmp_path: Path) -> None:
    port, ui = free_port(), free_port()
    proc = spawn(server_command(tmp_path / "t.db", port, ui, codec_endpoint=CODEC), tmp_path / "temporal.log")
    try:
        wait_for_port("127.0.0.1", ui, 60, proc)

        def settings() -> dict | None:
            try:
                r = httpx.get(f"http://127.0.0.1:{ui}/api/v1/settings", timeout=5)
            except httpx.HTTPError:
                return None
            return r.json() if r.status_code == 200 else None

        codec = wait_for(settings, 60, what="the UI's settings")["Codec"]
        assert codec["Endpoint"] == CODEC
    finally:
        stop_pid(proc.pid, proc)
