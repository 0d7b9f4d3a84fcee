"""Types of the engine fleet: its slots, health settings, errors (its events are ``spec.events``
``EngineEvent``)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from pydantic import BaseModel

from spec.status import SlotState


class HealthConfig(BaseModel):
    interval_s: float = 5.0  # between probe sweeps
    timeout_s: float = 5.0  # one /health_generate probe
    first_wait_s: float = 120.0  # a starting engine must be healthy within this; probes begin after
    failure_threshold: int = 1  # failed probes in a row before the engine is declared dead


class FleetError(RuntimeError):
    pass


class NoHealthyEngine(FleetError):
    """No engine can take a request now (retryable: recovery may bring one back)."""


class WeightMismatch(FleetError):
    def __init__(self, slots: list[int], detail: str) -> None:
        super().__init__(f"engines in slots {slots} disagree with the expected weights: {detail}")
        self.slots = slots


@dataclass
class Slot:
    index: int
    url: str
    port: int
    state: SlotState = SlotState.EMPTY
    proc: subprocess.Popen | None = None
    weight_version: str | None = None
    checksum: str | None = None
    restart_count: int = 0
    failures: int = 0
    launched: tuple[str, str | None] | None = None  # (model path, version) of the last spawn
    added: bool = False  # grown by ``EngineFleet.resize``, not started yet: its first start is no restart
