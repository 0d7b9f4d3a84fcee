"""torchft's lighthouse (the quorum server every DP cell's manager talks to) as a
supervised subprocess: started on a fixed port, restarted on the same port if it dies
(the cells' managers reconnect to the address they were given), stopped by pid."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from gpu_runtime.proc.http_client import http_client
from gpu_runtime.proc.processes import free_port, packaged_binary, pid_alive, reachable, signal_group, spawn, stop_pid

log = logging.getLogger(__name__)


class LighthouseFailed(RuntimeError):
    pass


def lighthouse_command(port: int, *, min_replicas: int = 1, join_timeout_ms: int = 1000,
                       heartbeat_timeout_ms: int = 1000, quorum_tick_ms: int = 100) -> list[str]:
    """``torchft_lighthouse`` (the console script of ``torchft-nightly``), watched: it ends when
    this process does (``gpu_runtime.proc.watched``), so a SIGKILLed trainer leaves none behind."""
    return [sys.executable, "-m", "gpu_runtime.proc.watched", "--parent-pid", str(os.getpid()), "--",
            packaged_binary("torchft_lighthouse", "torchft-nightly"),
            "--bind", f"127.0.0.1:{port}", "--min_replicas", str(min_replicas),
            "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", str(heartbeat_timeout_ms),
            "--quorum_tick_ms", str(quorum_tick_ms)]


@dataclass(frozen=True)
class LighthouseStatus:
    """What a lighthouse's /status page says: the id of the last quorum it formed (0 until
    its first: a restarted lighthouse counts from 0 again), the cells it hears heartbeats
    from, and the cells waiting for the next quorum; -1 where the page does not say."""

    quorum_id: int
    heartbeating: int
    pending: int


def lighthouse_status(address: str, client: httpx.Client) -> LighthouseStatus | None:
    """The lighthouse's /status page ("Current quorum_id: 3", "[2 heartbeating]", "only have
    1 participants"), or None when it does not answer (dead, or restarting)."""
    try:
        text = client.get(address + "/status").text
    except httpx.HTTPError:
        return None

    def number(pattern: str) -> int:
        m = re.search(pattern, text)
        return int(m.group(1)) if m else -1

    return LighthouseStatus(number(r"Current quorum_id:\s*(?:<[^>]*>\s*)*(\d+)"), number(r"\[(\d+) heartbeating\]"),
                            number(r"only have (\d+) participants"))


class Lighthouse:
    """One lighthouse for a group of cells. ``heartbeat_timeout_ms`` is how long a silent
    cell (dead or SIGSTOPped) stays in the quorum; ``join_timeout_ms`` how long a quorum
    waits for a live cell that has not joined the step yet."""

    def __init__(self, log_path: Path, *, join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 1000,
                 start_timeout_s: float = 30.0) -> None:
        self.log_path = log_path
        self.join_timeout_ms = join_timeout_ms
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self._http: httpx.Client | None = None
        self._child: int | None = None
        self._lock = threading.Lock()
        self.started_at = 0.0  # time.monotonic() when it last started listening

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        """The lighthouse's own pid (its watcher's child)."""
        if self.proc is None:
            return None
        if self._child is None:
            try:
                kids = psutil.Process(self.proc.pid).children()
                self._child = kids[0].pid if kids else None
            except psutil.NoSuchProcess:
                return None
        return self._child

    def alive(self) -> bool:
        """The watcher runs while the lighthouse does (it exits with it)."""
        return self.proc is not None and self.proc.poll() is None and self.pid is not None and pid_alive(self.pid)

    def start(self) -> None:
        if self.port == 0:
            self.port = free_port()
        self._child = None
        self.proc = spawn(lighthouse_command(self.port, join_timeout_ms=self.join_timeout_ms,
                                             heartbeat_timeout_ms=self.heartbeat_timeout_ms), self.log_path)
        deadline = time.monotonic() + self.start_timeout_s
        while not (reachable(f"127.0.0.1:{self.port}", 0.5) and self.pid is not None):
            if self.proc.poll() is not None:
                raise LighthouseFailed(f"torchft lighthouse exited with {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise LighthouseFailed(f"torchft lighthouse not listening on :{self.port} within "
                                       f"{self.start_timeout_s:.0f} s; see {self.log_path}")
            time.sleep(0.05)
        self.started_at = time.monotonic()
        log.info("torchft lighthouse pid %s (watcher %d) on %s", self.pid, self.proc.pid, self.address)

    def age_s(self) -> float:
        """Seconds since it last started listening."""
        return time.monotonic() - self.started_at

    def ensure_running(self) -> bool:
        """Restart a dead lighthouse on its port; whether it had to. Thread-safe: a step and a
        cell restart may both check it."""
        with self._lock:
            return self._ensure_running()

    def _ensure_running(self) -> bool:
        if self.alive():
            return False
        was, old_child = self.proc, self._child
        if was is not None:  # its process group: the watcher and whatever is left of the lighthouse
            signal_group(was.pid, signal.SIGKILL, was)
            was.wait()
            deadline = time.monotonic() + 10.0
            while old_child is not None and pid_alive(old_child) and time.monotonic() < deadline:
                time.sleep(0.02)  # the old lighthouse must let go of the port first
            # and its port: a SIGKILLed multi-threaded process is a zombie (not alive) while its
            # other threads still exit, holding the socket; a new lighthouse started then could
            # not bind, and the old socket answered for it
            while reachable(f"127.0.0.1:{self.port}", 0.2) and time.monotonic() < deadline:
                time.sleep(0.02)
        self.start()
        if was is not None:
            self.restarts += 1
            log.warning("torchft lighthouse (watcher pid %d) exited with %s; restarted as pid %s", was.pid, was.returncode,
                        self.pid)
        return was is not None

    def pending_requests(self) -> int:
        """How many cells have asked for the next quorum; -1 when the page does not say."""
        return self._status().pending

    def heartbeating(self) -> int:
        """How many cells' managers the lighthouse hears from; -1 when the page does not say."""
        return self._status().heartbeating

    def _status(self) -> LighthouseStatus:
        if self._http is None:
            self._http = http_client(timeout=2.0)
        return lighthouse_status(self.address, self._http) or LighthouseStatus(-1, -1, -1)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            stop_pid(proc.pid, proc)


class LighthouseWatchdog:
    """A thread that runs ``ensure`` (restart the lighthouse if it died, and report it) every
    ``every_s`` until ``stop``. Inside a step the cells' quorum requests fail while the
    lighthouse is gone (each retried after 15 s, 20 times), so it must come back whenever it
    dies, not only when the next step starts. A failed restart goes to ``on_error``; the
    next check tries again."""

    def __init__(self, ensure: Callable[[], None], on_error: Callable[[Exception], None], every_s: float = 0.5) -> None:
        self._ensure, self._on_error, self.every_s = ensure, on_error, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lighthouse-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self._ensure()
            except Exception as err:  # noqa: BLE001 - reported; the next check tries again
                log.warning("restarting the torchft lighthouse failed: %s", err)
                self._on_error(err)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60.0)
