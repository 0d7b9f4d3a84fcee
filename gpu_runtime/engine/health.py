"""A fleet's health checks: every healthy engine probed in parallel, in a background thread.

The probe is ``/health_generate`` (a one-token generation on SGLang), or ``/health``, which
generates nothing, while the engines' memory is released (``EngineMemory``).
``failure_threshold`` failed or timed-out probes in a row (or an exited process) make the
engine dead: the supervisor kills it and empties its slot (``SlotSupervisor.declare_dead``).
"""

from __future__ import annotations

import logging
import threading

from gpu_runtime.engine.client import EngineError
from gpu_runtime.engine.fleet_memory import EngineMemory
from gpu_runtime.engine.fleet_types import Slot
from gpu_runtime.engine.supervisor import SlotSupervisor
from spec.status import SlotState

log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(self, slots: SlotSupervisor, memory: EngineMemory) -> None:
        self.slots = slots
        self.memory = memory
        self.health = slots.health
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.slots.stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="HealthMonitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Sets the supervisor's ``stopping`` (it also ends every wait for a starting engine)."""
        self.slots.stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=self.health.timeout_s + 5)
            self._thread = None

    def _loop(self) -> None:
        while not self.slots.stopping.wait(self.health.interval_s):
            try:
                self.check_now()
            except Exception:  # noqa: BLE001 - keep monitoring
                log.exception("health sweep failed")

    def probe(self, s: Slot) -> tuple[Slot, bool, bool, str]:
        """``/health_generate`` (a one-token generation on SGLang); while released ``/health``:
        a generation on released memory (SGLang) is what must not happen."""
        c = self.slots.backend.client(s.url, self.health.timeout_s)
        try:
            if self.memory.released:
                c.check_health(self.health.timeout_s)
            else:
                c.check_health_generate(self.health.timeout_s)
            return s, True, False, ""
        except EngineError as e:
            return s, False, e.timeout, str(e)
        finally:
            c.close()

    def check_now(self) -> None:
        """One sweep: reap exited engines, then probe all healthy engines in parallel."""
        with self.memory.phase:
            self._sweep()

    def _sweep(self) -> None:
        for s in list(self.slots.slots):
            proc = s.proc
            if s.state == SlotState.HEALTHY and proc is not None and proc.poll() is not None:
                self.slots.declare_dead(s, f"process exited rc={proc.returncode}", hung=False)
        targets = [s for s in self.slots.slots if s.state == SlotState.HEALTHY]
        for s, ok, timed_out, detail in self.slots.pool.map(self.probe, targets):
            if ok:
                s.failures = 0
                continue
            s.failures += 1
            log.warning("slot %d: probe failed (%d/%d): %s", s.index, s.failures,
                        self.health.failure_threshold, detail)
            if s.failures >= self.health.failure_threshold:
                self.slots.declare_dead(s, f"health_generate failed: {detail}", hung=timed_out)
