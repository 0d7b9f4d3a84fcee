"""Real processes for integration tests: a Temporal dev server and our workers.

Every process is started in its own session and stopped by pid at teardown,
also when the test fails.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar


from gpu_runtime.node.children_file import left_behind, read_children, stop_left_behind
from gpu_runtime.proc.processes import free_port, spawn, stop_pid
from gpu_runtime.trainer.work_dir import versions_root
from infra.temporal_server import server_command, wait_for_port, wait_until_serving

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout_s: float = 60.0, interval_s: float = 0.1, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


async def async_wait_for(cond: Callable, timeout_s: float = 60.0, interval_s: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = await cond()
        if value:
            return value
        await asyncio.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


class TemporalDevServer:
    """``ui=True`` also serves the Temporal web UI (on ``ui_port``), for the browser check."""

    def __init__(self, workdir: Path, ui: bool = False) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.ui_port = free_port() if ui else None
        self.proc: subprocess.Popen | None = None
        self._started = False  # once started, the frontend port is the workers' address

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, attempts: int = 4) -> None:
        """Start the server. ``free_port`` only proposes a port: until the server binds it,
        any process's outgoing connection may take it as its local port (CI once lost a
        module's stack to ``bind: address already in use``, and an open port may be another
        process's). Such a start is retried with fresh ports (the frontend port only before
        the first start: workers keep its address across a restart); any other failure
        raises with the log's tail."""
        log_path = self.workdir / "temporal.log"
        for attempt in range(1, attempts + 1):
            cmd = server_command(
                self.workdir / "temporal.db", self.port, self.ui_port, http_port=free_port(), metrics_port=free_port()
            )
            log_start = log_path.stat().st_size if log_path.exists() else 0
            self.proc = spawn(cmd, log_path)
            try:
                wait_for_port("127.0.0.1", self.port, 60, self.proc)
                if self.ui_port is not None:
                    wait_for_port("127.0.0.1", self.ui_port, 60, self.proc)
                # an open port may be another process's (the server then fails to bind it and
                # exits: a loaded test run saw the TLS module wait 60 s on a dead server), so the start
                # counts once a client is served by this process
                wait_until_serving(self.address, proc=self.proc)
            except RuntimeError as err:  # the server exited before it served
                self.stop()
                out = log_path.read_bytes()[log_start:].decode(errors="replace").strip()
                if "address already in use" in out and attempt < attempts:
                    if not self._started:
                        self.port = free_port()
                        self.ui_port = free_port() if self.ui_port is not None else None
                    continue
                raise RuntimeError(f"{err}; {log_path} says: {out[-2000:]}") from err
            break
        self._started = True

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            stop_pid(self.proc.pid, self.proc)
            self.proc = None


class Stack:
    """Temporal dev server + ``workers.control`` + ``workers.gpu`` processes."""

    def __init__(self, workdir: Path, env: dict[str, str] | None = None, ui: bool = False) -> None:
        self.workdir = workdir
        self.server = TemporalDevServer(workdir, ui=ui)
        self.procs: dict[str, subprocess.Popen] = {}
        self.extra_env = dict(env or {})
        self.metrics_ports: dict[str, int] = {}

    @property
    def env(self) -> dict[str, str]:
        return {"MILESTONE_TEMPORAL_ADDRESS": self.server.address, "PYTHONPATH": str(ROOT), **self.extra_env}

    def start(self, gpu_nodes: tuple[str, ...] = ("node0",)) -> Stack:
        self.server.start()
        self.start_control()
        for node in gpu_nodes:
            self.start_gpu(node)
        return self

    def start_control(self) -> subprocess.Popen:
        return self._spawn("control", [sys.executable, "-m", "workers.control"])

    def start_gpu(self, node_id: str, name: str | None = None, extra: tuple[str, ...] = ()) -> subprocess.Popen:
        """A node agent; ``extra``: more flags (``--role rollout``)."""
        self.metrics_ports[node_id] = free_port()
        return self._spawn(
            name or f"gpu-{node_id}",
            [sys.executable, "-m", "workers.gpu", "--device", "cpu", "--node-id", node_id,
             "--work-dir", str(self.workdir / "nodes" / node_id),
             "--metrics-port", str(self.metrics_ports[node_id]), *extra],
        )

    def scrape(self, node_id: str) -> dict[str, float]:
        """The node agent's Prometheus metrics as {'name{labels}': value}."""
        import httpx

        text = httpx.get(f"http://127.0.0.1:{self.metrics_ports[node_id]}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        proc = spawn(cmd, self.workdir / "logs" / f"{name}.log", env=self.env)
        self.procs[name] = proc
        return proc

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)

    def node_pids(self, node_id: str) -> dict:
        """{"agent", "trainer", "router", "engines": [...]} as the node agent last wrote them."""
        return read_children(self.workdir / "nodes" / node_id)

    def node_children(self, node_id: str) -> list[int]:
        """The node agent's trainer, router and engines still running (a pid they had that
        another process has now is not one of them)."""
        return [pid for pid, _ in left_behind(self.workdir / "nodes" / node_id)]

    def stop(self) -> None:
        for proc in list(self.procs.values()):
            if proc.poll() is None:
                stop_pid(proc.pid, proc, timeout_s=20)
        for node_dir in (self.workdir / "nodes").glob("*"):  # children of a SIGKILLed agent
            stop_left_behind(node_dir)
            shutil.rmtree(versions_root(node_dir / "trainer"), ignore_errors=True)  # $MILESTONE_VERSIONS_DIR: outside workdir
        self.server.stop()

    def log(self, name: str) -> str:
        path = self.workdir / "logs" / f"{name}.log"
        return path.read_text() if path.exists() else ""


def tiny_config(store_dir: Path, **overrides: object) -> dict:
    """A run small enough for CI: tiny model, few prompts, short SFT."""
    cfg: dict = {
        "name": "t",
        "seed": 7,
        "steps": 3,
        "store": f"file://{store_dir}",
        "model": {"init": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_key_value_heads": 2}},
        "data": {"kind": "arithmetic", "num_train": 200, "max_operand": 9},
        "sft": {"steps": 100, "batch_size": 32, "lr": 3e-3},
        "rollout": {"prompts_per_step": 4, "group_size": 4, "chunk_size": 8, "max_new_tokens": 4},
        "train": {"lr": 1e-4},
        "checkpoint": {"every": 1, "keep_last": 2},
        "eval": {"n": 8, "k": 4},  # after the last step only; 11 prompts of 0..9 + 0..9 are not in the train set
        "engines": {"num_engines": 2, "health_check_interval_s": 1, "health_check_timeout_s": 5},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


@contextmanager
def running_stack(
    workdir: Path, env: dict[str, str] | None = None, gpu_nodes: tuple[str, ...] = ("node0",), ui: bool = False
) -> Iterator[Stack]:
    """A started Stack, stopped (by pid) however the block ends."""
    stack = Stack(workdir, env=env, ui=ui)
    try:
        stack.start(gpu_nodes)
        yield stack
    finally:
        stack.stop()
