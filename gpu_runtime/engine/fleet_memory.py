"""A fleet's engines between RL phases (``engines.release_memory``): released while the trainer
trains, resumed before they generate, and pushed their weights again when a resume does not
bring them back (SGLang with ``--enable-memory-saver``, no CPU backup of the weights).

While released, the fleet's health probe asks ``/health`` (on SGLang: no generation), never
``/health_generate``: a one-token generation on released memory is what must not happen.
Mixed into ``EngineFleet``, whose slots, clients and weight push it uses.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpu_runtime.engine.backends import EngineBackend
from gpu_runtime.engine.client import EngineClient, EngineError
from gpu_runtime.engine.fleet_types import _Slot

log = logging.getLogger(__name__)


class FleetMemoryPhases:
    backend: EngineBackend
    slots: list[_Slot]
    model_path: str
    weight_version: str | None
    _pool: ThreadPoolExecutor

    def _init_memory_phases(self) -> None:
        self.released = False  # the engines' memory is released (training phase)
        self._phase = threading.RLock()  # a probe sweep and a release or resume never overlap
        self._push_lock = threading.Lock()
        self.push_pending = False  # resumed engines that lost their weights wait for a push

    # provided by EngineFleet
    def _client(self, url: str) -> EngineClient: ...

    def _declare_dead(self, s: _Slot, detail: str, *, hung: bool) -> None: ...

    def update_weights(self, model_path: str | Path, version: int | str) -> dict[int, str]: ...

    def release_memory(self) -> list[int]:
        """Every healthy engine frees its weights and KV cache on its device (the trainer
        trains meanwhile); they stay healthy (probed by ``/health``, no generation). An engine
        that fails to release is replaced like a dead one. Returns the released slots."""
        with self._phase:
            self.released = True  # before the first release: no generating probe from here on
            return self._on_each_healthy("release", lambda c: c.release_memory_occupation())

    def resume_memory(self, *, push: bool = True) -> list[int]:
        """Every healthy engine takes its memory back; a no-op unless ``release_memory`` ran.
        Torch engines verify their weights' checksum themselves; engines that lose their weights
        when released (SGLang) get the served version pushed (from its folder, probe-verified)
        before they serve: now, or with ``push=False`` by the caller's own push
        (``update_weights``), at the latest before the next chunk. An engine that fails to
        resume is declared dead, so the gated recovery that follows restarts it."""
        with self._phase:
            if not self.released:
                return []
            done = self._on_each_healthy("resume", lambda c: c.resume_memory_occupation())
            self.released = False
            self.push_pending = not self.backend.keeps_weights_when_released
        if push:
            self.push_if_pending()
        return done

    def push_if_pending(self) -> None:
        """The served version pushed again to engines resumed without their weights."""
        with self._push_lock:
            if self.push_pending:
                log.info("engines resumed without their weights: pushing version %s again", self.weight_version)
                self.update_weights(self.model_path, self.weight_version or "")

    def _on_each_healthy(self, what: str, call: Callable[[EngineClient], Any]) -> list[int]:
        targets = [s for s in self.slots if s.state == "healthy"]

        def one(s: _Slot) -> str | None:
            try:
                call(self._client(s.url))
                return None
            except EngineError as e:
                return str(e)

        done: list[int] = []
        for s, err in zip(targets, self._pool.map(one, targets)):
            if err is None:
                done.append(s.index)
            else:
                self._declare_dead(s, f"{what} memory occupation failed: {err}", hung=False)
        log.info("engines %s memory: slots %s", what, done)
        return done
