"""A fleet's engines between RL phases (``engines.release_memory``): released while the trainer
trains, resumed before they generate, and pushed their weights again when a resume does not
bring them back (SGLang with ``--enable-memory-saver``, no CPU backup of the weights).

While released, the fleet's health probe asks ``/health`` (on SGLang: no generation), never
``/health_generate``: a one-token generation on released memory is what must not happen.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from gpu_runtime.engine.client import EngineClient, EngineError
from gpu_runtime.engine.fleet_types import Slot
from gpu_runtime.engine.supervisor import SlotSupervisor
from spec.status import SlotState

log = logging.getLogger(__name__)


class EngineMemory:
    """``push_served``: the fleet's weight push of the version it serves (``EngineFleet``)."""

    def __init__(self, slots: SlotSupervisor, push_served: Callable[[], object]) -> None:
        self.slots = slots
        self._push_served = push_served
        self.released = False  # the engines' memory is released (training phase)
        self.phase = threading.RLock()  # a probe sweep and a release or resume never overlap
        self._push_lock = threading.Lock()
        self.push_pending = False  # resumed engines that lost their weights wait for a push

    def release(self) -> list[int]:
        """Every healthy engine frees its weights and KV cache on its device (the trainer
        trains meanwhile); they stay healthy (probed by ``/health``, no generation). An engine
        that fails to release is replaced like a dead one. Returns the released slots."""
        with self.phase:
            self.released = True  # before the first release: no generating probe from here on
            return self._on_each_healthy("release", lambda c: c.release_memory_occupation())

    def resume(self, *, push: bool = True) -> list[int]:
        """Every healthy engine takes its memory back; a no-op unless ``release`` ran.
        Torch engines verify their weights' checksum themselves; engines that lose their weights
        when released (SGLang) get the served version pushed (from its folder, probe-verified)
        before they serve: now, or with ``push=False`` by the caller's own push
        (``update_weights``), at the latest before the next chunk. An engine that fails to
        resume is declared dead, so the gated recovery that follows restarts it."""
        with self.phase:
            if not self.released:
                return []
            done = self._on_each_healthy("resume", lambda c: c.resume_memory_occupation())
            self.released = False
            self.push_pending = not self.slots.backend.keeps_weights_when_released
        if push:
            self.push_if_pending()
        return done

    def push_if_pending(self) -> None:
        """The served version pushed again to engines resumed without their weights."""
        with self._push_lock:
            if self.push_pending:
                log.info("engines resumed without their weights: pushing version %s again", self.slots.weight_version)
                self._push_served()

    def _on_each_healthy(self, what: str, call: Callable[[EngineClient], Any]) -> list[int]:
        targets = [s for s in self.slots.slots if s.state == SlotState.HEALTHY]

        def one(s: Slot) -> str | None:
            try:
                call(self.slots.client(s.url))
                return None
            except EngineError as e:
                return str(e)

        done: list[int] = []
        for s, err in zip(targets, self.slots.pool.map(one, targets)):
            if err is None:
                done.append(s.index)
            else:
                self.slots.declare_dead(s, f"{what} memory occupation failed: {err}", hung=False)
        log.info("engines %s memory: slots %s", what, done)
        return done
