"""A node's rollout engines: slots, parallel health checks, gated recovery, weight sync.

Each slot runs one engine subprocess (torch, SGLang or vLLM backend). The fleet is made of
one part per job, each in its module:

- ``SlotSupervisor`` (``supervisor``): the slots' engines started, declared dead (SIGKILLed
  by pid, out of the router at once, the slot ``empty``), resized, and restarted by the
  *gated recovery* that precedes a weight update (``restart_empty_slots``);
- ``HealthMonitor`` (``health``): every healthy engine probed *in parallel* in the
  background, ``failure_threshold`` failed probes in a row making it dead;
- ``RequestDispatch`` (``dispatch``): a chunk to a healthy engine, resent to a survivor
  when its engine fails;
- ``WeightPush`` (``weight_push``): a version delivered by the run's weight-sync strategy
  (``gpu_runtime.weight_sync.strategies``), then checksum-gated;
- ``EngineMemory`` (``fleet_memory``): the engines' memory released and resumed between
  RL phases (``engines.release_memory``).

``EngineFleet`` wires them and is what the node and the tests hold.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_runtime.engine.auth import check_exposure, engine_token
from gpu_runtime.engine.backends import EngineBackend
from gpu_runtime.engine.dispatch import RequestDispatch
from gpu_runtime.engine.fleet_memory import EngineMemory
from gpu_runtime.engine.fleet_types import FleetError, HealthConfig, Slot
from gpu_runtime.engine.health import HealthMonitor
from gpu_runtime.engine.router import RouterProcess
from gpu_runtime.engine.supervisor import SlotSupervisor
from gpu_runtime.engine.weight_push import WeightPush
from gpu_runtime.weight_sync.distributed_push import Broadcaster, PushResult
from gpu_runtime.weight_sync.member_push import GroupMember
from spec.events import EngineEvent
from spec.status import EngineSlotInfo


class EngineFleet:
    def __init__(
        self,
        backend: EngineBackend,
        num_slots: int,
        model_path: str | Path,
        base_port: int,
        log_dir: str | Path,
        router: RouterProcess | None = None,
        health: HealthConfig | None = None,
        *,
        weight_version: int | str | None = None,
        on_event: Callable[[EngineEvent], None] | None = None,
        generate_timeout_s: float = 600.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.backend = backend
        self.log_dir = Path(log_dir)
        check_exposure(host, engine_token(), "engine")  # before any engine is spawned
        self.supervisor = SlotSupervisor(
            backend, num_slots, str(model_path), None if weight_version is None else str(weight_version), base_port,
            self.log_dir, host, health or HealthConfig(), router, on_event, generate_timeout_s,
        )
        self.memory = EngineMemory(self.supervisor, self._push_served)  # engines.release_memory
        self.monitor = HealthMonitor(self.supervisor, self.memory)
        self.weights = WeightPush(self.supervisor, f"fleet{base_port}")  # engines.weight_sync
        self.dispatch = RequestDispatch(self.supervisor, self.monitor, self.memory)

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        bad = self.supervisor.start_all()
        if bad:
            self.stop()
            raise FleetError(f"engines in slots {bad} did not become healthy; logs in {self.log_dir}")
        self.supervisor.join_router()
        self.monitor.start()

    def stop(self) -> None:
        self.weights.close()
        self.monitor.stop()
        self.supervisor.stop()

    def __enter__(self) -> EngineFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- what the node and the run see -------------------------------------------------
    @property
    def slots(self) -> list[Slot]:
        return self.supervisor.slots

    @property
    def events(self) -> list[EngineEvent]:
        return self.supervisor.events

    @property
    def router(self) -> RouterProcess | None:
        return self.supervisor.router

    @router.setter
    def router(self, router: RouterProcess | None) -> None:
        self.supervisor.router = router

    @property
    def on_event(self) -> Callable[[EngineEvent], None] | None:
        return self.supervisor.on_event

    @on_event.setter
    def on_event(self, on_event: Callable[[EngineEvent], None] | None) -> None:
        self.supervisor.on_event = on_event

    @property
    def released(self) -> bool:
        return self.memory.released

    @property
    def last_push(self) -> PushResult | None:
        return self.weights.last_push

    def healthy_urls(self) -> list[str]:
        return self.supervisor.healthy_urls()

    def snapshot(self) -> list[EngineSlotInfo]:
        return self.supervisor.snapshot()

    # ---- the parts' jobs -----------------------------------------------------------------
    def kill_slot(self, i: int, detail: str = "killed by request") -> None:
        self.supervisor.kill_slot(i, detail)

    def check_now(self) -> None:
        self.monitor.check_now()

    def resize(self, n: int) -> None:
        self.supervisor.resize(n)

    @property
    def model_path(self) -> str:
        """The folder of the version the fleet serves (what an engine restarted with no argument loads)."""
        return self.supervisor.model_path

    def restart_empty_slots(self, model_path: str | Path | None = None, version: int | str | None = None) -> list[int]:
        return self.supervisor.restart_empty_slots(model_path, version)

    def update_weights(
        self, model_path: str | Path, version: int | str, sync: str = "store", broadcaster: Broadcaster | None = None,
        member: GroupMember | None = None,
    ) -> dict[int, str]:
        """``WeightPush.update_weights``; engines resumed without their weights have them again."""
        verified = self.weights.update_weights(model_path, version, sync, broadcaster, member)
        self.memory.push_pending = False
        return verified

    def generate_chunk(
        self, batch: list[list[int]], sampling_params: dict[str, Any], *, return_logprob: bool = True,
        max_attempts: int | None = None, affinity: str | None = None,
    ) -> tuple[list[dict[str, Any]], str]:
        return self.dispatch.generate_chunk(batch, sampling_params, return_logprob=return_logprob,
                                            max_attempts=max_attempts, affinity=affinity)

    def release_memory(self) -> list[int]:
        return self.memory.release()

    def resume_memory(self, *, push: bool = True) -> list[int]:
        return self.memory.resume(push=push)

    def _push_served(self) -> None:
        """The version the fleet serves, pushed again (to engines resumed without their weights)."""
        self.update_weights(self.supervisor.model_path, self.supervisor.weight_version or "")
