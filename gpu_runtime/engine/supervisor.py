"""Slot supervision: which engine runs in which slot of a fleet, and what happens when one dies.

Each slot runs one engine subprocess (``SlotProcesses`` starts and kills them). An engine
declared dead (by the ``HealthMonitor``, a failed request, a failed weight load) is
SIGKILLed by pid (this also ends a SIGSTOPped engine), removed from the router at once, and
its slot becomes ``empty``. Empty slots are refilled only by ``restart_empty_slots`` (the
*gated recovery* that precedes a weight update), which loads the newest weights, passes the
checksum gate and re-adds the engine to the router. Every change is an event (``spec.events.EngineEvent``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gpu_runtime.engine.backends import EngineBackend
from gpu_runtime.engine.client import EngineClient
from gpu_runtime.engine.fleet_types import HealthConfig, Slot
from gpu_runtime.engine.router import RouterError, RouterProcess
from gpu_runtime.engine.slots import SlotProcesses
from gpu_runtime.engine.weight_gate import WeightGate
from gpu_runtime.proc.processes import free_port
from spec.event_text import event_text
from spec.events import (
    EngineAdded, EngineChecksum, EngineDead, EngineEvent, EngineHung, EngineRecovered, EngineRemoved, EngineRestarted,
    utc_now,
)
from spec.status import EngineSlotInfo, SlotState

log = logging.getLogger(__name__)


class SlotSupervisor:
    """The fleet's slots and the version new engines start with (``model_path``,
    ``weight_version``: the newest the fleet was given). ``lock`` guards the slots' fields;
    ``pool`` runs the fleet's per-engine calls in parallel; ``stopping`` is set while the
    fleet stops (it ends every wait for a starting engine)."""

    def __init__(
        self, backend: EngineBackend, num_slots: int, model_path: str, weight_version: str | None, base_port: int,
        log_dir: Path, host: str, health: HealthConfig, router: RouterProcess | None,
        on_event: Callable[[EngineEvent], None] | None, generate_timeout_s: float,
    ) -> None:
        self.backend = backend
        self.model_path = model_path
        self.weight_version = weight_version
        self.log_dir = log_dir
        self.health = health
        self.router = router
        self.on_event = on_event
        self.generate_timeout_s = generate_timeout_s
        self.slots = [Slot(i, f"http://{host}:{base_port + i}", base_port + i) for i in range(num_slots)]
        self.events: list[EngineEvent] = []
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.pool = ThreadPoolExecutor(max_workers=max(4, num_slots), thread_name_prefix="fleet")
        self.gate = WeightGate(backend, self.client)
        self._clients: dict[str, EngineClient] = {}
        self._procs = SlotProcesses(backend, log_dir, host, health, self.lock, self.stopping)
        self._owns_router = False

    # ---- lifecycle -------------------------------------------------------------------
    def start_all(self) -> list[int]:
        """Start an engine in every slot and wait until they are healthy: the slots that did not become so."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for s in self.slots:
            self._procs.spawn(s, self.model_path, self.weight_version)
        ok = self._procs.wait_all_healthy(self.slots)
        return [s.index for s, good in zip(self.slots, ok) if not good]

    def join_router(self) -> None:
        """The healthy engines become the router's members (a router not running yet is started, and ours)."""
        if self.router is not None:
            if self.router.proc is None:
                self.router.initial_workers = []
                self.router.start()
                self._owns_router = True
            self.router.sync(self.healthy_urls())

    def stop(self) -> None:
        """Kill every engine, stop the router when it is ours, close the clients."""
        for s in self.slots:
            self._procs.kill(s)
            s.state = SlotState.EMPTY
        if self.router is not None and self._owns_router:
            self.router.stop()
            self._owns_router = False
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    # ---- queries ---------------------------------------------------------------------
    def healthy(self) -> list[Slot]:
        return [s for s in self.slots if s.state == SlotState.HEALTHY]

    def healthy_urls(self) -> list[str]:
        with self.lock:
            return [s.url for s in self.slots if s.state == SlotState.HEALTHY]

    def snapshot(self) -> list[EngineSlotInfo]:
        """Every slot as the run's status shows it (a version that is no number: None)."""
        with self.lock:
            return [
                EngineSlotInfo(slot=s.index, pid=s.proc.pid if s.proc else None, url=s.url, state=s.state,
                               weight_version=int(s.weight_version) if s.weight_version and s.weight_version.isdigit() else None,
                               checksum=s.checksum, restart_count=s.restart_count)
                for s in self.slots
            ]

    def client(self, url: str) -> EngineClient:
        """The engine's client, kept for the fleet's life (generation, weight reads, memory calls)."""
        with self.lock:
            if url not in self._clients:
                self._clients[url] = self.backend.client(url, self.generate_timeout_s)
            return self._clients[url]

    def read_weights(self, s: Slot) -> tuple[str | None, str | None]:
        """(weight version, checksum) the slot's engine reports."""
        return self._procs.read_weights(self.client(s.url))

    # ---- slots and events ------------------------------------------------------------
    def kill_slot(self, i: int, detail: str = "killed by request") -> None:
        self.declare_dead(self.slots[i], detail, hung=False)

    def declare_dead(self, s: Slot, detail: str, *, hung: bool) -> None:
        with self.lock:
            if s.state not in (SlotState.HEALTHY, SlotState.STARTING):
                return
            s.state = SlotState.DEAD
            pid = s.proc.pid if s.proc else None
        try:
            if hung:
                self.emit(EngineHung(at=utc_now(), slot=s.index, reason=detail))
            self._procs.kill(s)
            if self.router is not None:
                try:
                    self.router.remove_worker(s.url)
                except (RouterError, ValueError) as e:
                    log.warning("slot %d: could not remove %s from router: %s", s.index, s.url, e)
        finally:  # a slot left "dead" would never be restarted (recovery restarts "empty" slots)
            with self.lock:
                s.state, s.weight_version, s.checksum, s.failures = SlotState.EMPTY, None, None, 0
        # emitted once the engine is killed, reaped and out of the router
        self.emit(EngineDead(at=utc_now(), slot=s.index, pid=pid, reason=detail))

    def emit(self, ev: EngineEvent) -> None:
        with self.lock:
            self.events.append(ev)
        log.info("fleet event %s %s", ev.kind, event_text(ev))
        if self.on_event is not None:
            try:
                self.on_event(ev)
            except Exception:  # noqa: BLE001 - a callback must not break health checking
                log.exception("on_event callback failed")

    # ---- resize and recovery ---------------------------------------------------------
    def resize(self, n: int) -> None:
        """``engines.num_engines`` changed mid-run: shrink stops the highest slots (out of the
        router first, so no request is routed to a dying engine); grow adds empty slots on
        free ports, which ``restart_empty_slots`` starts with the newest weights, gated and
        checksum-verified like any recovery."""
        if n < 1:
            raise ValueError(f"engines.num_engines must be >= 1, got {n}")
        with self.lock:
            gone, self.slots = self.slots[n:], self.slots[:n]
            host = self.slots[0].url.rsplit(":", 1)[0]
            ports = [free_port() for _ in range(n - len(self.slots))]
            self.slots += [Slot(len(self.slots) + i, f"{host}:{p}", p, added=True) for i, p in enumerate(ports)]
        for s in gone:
            if self.router is not None:
                self.router.remove_worker(s.url)
            self._procs.kill(s)
            s.state = SlotState.EMPTY
            self.emit(EngineRemoved(at=utc_now(), slot=s.index, num_engines=n))
        for s in self.slots:
            if s.added:
                self.emit(EngineAdded(at=utc_now(), slot=s.index, num_engines=n, port=s.port))
        if n > self.pool._max_workers:  # one thread per slot for a chunk fan-out
            old, self.pool = self.pool, ThreadPoolExecutor(max_workers=n, thread_name_prefix="fleet")
            old.shutdown(wait=False)

    def restart_empty_slots(self, model_path: str | Path | None = None, version: int | str | None = None) -> list[int]:
        """Gated recovery: start engines in empty slots with the given (newest) weights,
        wait until healthy, verify the checksum and re-add them to the router (slots that
        ``resize`` added start here the same way)."""
        if model_path is not None:
            self.model_path = str(model_path)
            self.weight_version = None if version is None else str(version)
        empty = [s for s in self.slots if s.state == SlotState.EMPTY]
        for s in empty:
            with self.lock:
                s.restart_count += not s.added
                added, s.added = s.added, False
            self._procs.spawn(s, self.model_path, self.weight_version)
            if not added:
                self.emit(EngineRestarted(at=utc_now(), slot=s.index, pid=s.proc.pid if s.proc else None,
                                          model_path=self.model_path))
        ok = self._procs.wait_all_healthy(empty)
        expected = self.gate.expected_checksum(self.model_path)
        recovered: list[int] = []
        for s, good in zip(empty, ok):
            if not good:
                self.declare_dead(s, "did not become healthy after restart", hung=False)
                continue
            wrong: list[str] = []  # the sampled parameters that differ
            if not self.backend.supports_checksum:  # no hash (SGLang): the sampled-parameter probe
                s.checksum, wrong = self.gate.probe_verified(s, self.model_path)
                bad = s.checksum is None
            else:
                bad = expected is not None and s.checksum != expected
            if bad:
                self.emit(EngineChecksum(at=utc_now(), kind="checksum_mismatch", slot=s.index, checksum=s.checksum,
                                         expected=expected, mismatched=wrong))
                self.declare_dead(s, "checksum mismatch after restart", hung=False)
                continue
            if self.router is not None:
                self.router.remove_worker(s.url)  # a stale entry would sit behind the circuit breaker
                self.router.add_worker(s.url)
            self.emit(EngineRecovered(at=utc_now(), slot=s.index, version=s.weight_version))
            recovered.append(s.index)
        return recovered
