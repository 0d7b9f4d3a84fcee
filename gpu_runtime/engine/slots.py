"""The engine subprocess of each fleet slot: started (moved to a free port when its own is
taken), awaited until it answers ``/health_generate`` with its weights read, and killed by
pid (which also ends a SIGSTOPped engine). ``EngineFleet`` decides when; this does it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpu_runtime.engine.backends import EngineBackend
from gpu_runtime.engine.client import EngineClient, EngineError
from gpu_runtime.engine.fleet_types import HealthConfig, Slot
from gpu_runtime.proc.processes import free_port, port_free, signal_group
from spec.status import SlotState

log = logging.getLogger(__name__)
PORT_MOVES = 3  # a starting engine whose port another process took moves this many times at most


class SlotProcesses:
    """``lock`` guards the slots' fields (the fleet's); ``stopping`` ends every wait (the fleet stops)."""

    def __init__(
        self, backend: EngineBackend, log_dir: Path, host: str, health: HealthConfig, lock: threading.RLock,
        stopping: threading.Event,
    ) -> None:
        self.backend = backend
        self.log_dir = log_dir
        self.host = host
        self.health = health
        self._lock = lock
        self._stopping = stopping

    def spawn(self, s: Slot, model_path: str, version: str | None) -> None:
        # another process listens there since the fleet chose it: move the slot (the engine
        # binds with SO_REUSEADDR, so its own predecessor's TIME_WAIT is no reason to move)
        if not port_free(s.port, reuse_address=True):
            old_url = s.url
            self._move(s)
            log.warning("slot %d: port of %s is taken; the slot moves to %s", s.index, old_url, s.url)
        cmd = self.backend.command(model_path=model_path, port=s.port, host=self.host, weight_version=version)
        cmd += self.backend.slot_args(s.index)
        logf = open(self.log_dir / f"engine-{s.index}.log", "ab")
        try:
            proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=self.backend.env(),
                                    start_new_session=True)
        finally:
            logf.close()
        with self._lock:
            s.proc, s.state, s.failures = proc, SlotState.STARTING, 0
            s.weight_version, s.checksum, s.launched = None, None, (model_path, version)
        log.info("slot %d: started pid=%d %s", s.index, proc.pid, " ".join(cmd))

    def _move(self, s: Slot) -> None:
        s.port = free_port()
        s.url = f"http://{self.host}:{s.port}"

    def wait_all_healthy(self, slots: list[Slot]) -> list[bool]:
        if not slots:
            return []
        with ThreadPoolExecutor(max_workers=len(slots), thread_name_prefix="fleet-start") as pool:
            return list(pool.map(self.wait_healthy, slots))

    def wait_healthy(self, s: Slot) -> bool:
        """Wait until a starting engine answers /health_generate; fills version and checksum."""
        deadline = time.monotonic() + self.health.first_wait_s
        probe = self.backend.client(s.url, self.health.timeout_s)
        moves = 0
        try:
            while time.monotonic() < deadline and not self._stopping.is_set():
                proc = s.proc
                if proc is None or proc.poll() is not None:
                    if proc is not None and moves < PORT_MOVES and s.launched and self._lost_its_port(s):
                        # the port was free when chosen, but another process (often an outgoing
                        # connection's ephemeral port) bound it while the engine loaded its model
                        moves += 1
                        old = s.url
                        self._move(s)
                        log.warning("slot %d: %s was taken while its engine started; the slot moves to %s",
                                    s.index, old, s.url)
                        self.spawn(s, *s.launched)
                        # a new process: the whole first wait again (CI: under load the first start took
                        # most of it, and the moved engine was declared unhealthy while it loaded)
                        deadline = time.monotonic() + self.health.first_wait_s
                        probe.close()
                        probe = self.backend.client(s.url, self.health.timeout_s)
                        continue
                    log.error("slot %d: engine exited during start (rc=%s)", s.index, proc and proc.returncode)
                    return False
                if probe.health() and probe.health_generate(self.health.timeout_s):
                    self.backend.started(probe, s.launched[1] if s.launched else None)
                    version, checksum = self.read_weights(probe)
                    with self._lock:
                        s.state, s.weight_version, s.checksum, s.failures = SlotState.HEALTHY, version, checksum, 0
                    log.info("slot %d: healthy pid=%d version=%s", s.index, proc.pid, version)
                    return True
                time.sleep(0.1)
            return False
        finally:
            probe.close()

    def _lost_its_port(self, s: Slot) -> bool:
        """Whether the slot's engine exited because its port was in use (the end of its log)."""
        try:
            with open(self.log_dir / f"engine-{s.index}.log", "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 4096))
                return b"Address already in use" in f.read()
        except OSError:
            return False

    def read_weights(self, c: EngineClient) -> tuple[str | None, str | None]:
        """(weight version, checksum) the engine reports (no checksum from a backend without one)."""
        try:
            if self.backend.supports_checksum:
                checksum, version = c.weights_checksum()
                return version, checksum
            return str(c.model_info().get("weight_version")), None
        except EngineError as e:
            log.warning("could not read weights info from %s: %s", c.base_url, e)
            return None, None

    def kill(self, s: Slot) -> None:
        proc = s.proc
        s.proc = None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGKILL)  # works on a SIGSTOPped process too
            except ProcessLookupError:
                pass
        # its children too (vLLM's EngineCore and Worker outlive a killed API server): the engine
        signal_group(proc.pid, signal.SIGKILL, proc)  # leads its own group (start_new_session)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.error("slot %d: pid %d did not exit after SIGKILL", s.index, proc.pid)
