"""The node agent's handle on its trainer subprocess: start, restart, stop by pid,
and a typed client for its RPC (arguments and results are ``spec.trainer_rpc`` models)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from gpu_runtime.proc.metrics import TRAINER_RESTARTS
from gpu_runtime.proc.devices import child_env, gpu_list
from gpu_runtime.proc.processes import stop_pid
from gpu_runtime.proc.rpc import RPCClient, ServerDidNotStart, start_rpc_process
from spec.event_text import event_text
from spec.events import RunEvent, TrainerRestarted, utc_now
from spec.rpc import RpcMethod
from spec.trainer_rpc import (
    BROADCAST_WEIGHTS,
    CHECKPOINT,
    ENSURE_VERSION,
    FORGET_RUN,
    HELD_WEIGHTS,
    RESTART_CELLS,
    TRAIN_STEP,
    BroadcastWeightsCall,
    CellsRestarted,
    CheckpointCall,
    CheckpointRequest,
    CheckpointSaved,
    EnsureVersionCall,
    ForgetRunCall,
    HeldWeights,
    HeldWeightsCall,
    RestartCellsCall,
    RunForgotten,
    RunSetup,
    StepBatch,
    TrainResult,
    TrainStepCall,
    VersionInfo,
    WeightsBroadcast,
)

from gpu_runtime.weight_sync.distributed_push import Broadcaster
from gpu_runtime.weight_sync.distributed import DEFAULT_TIMEOUT_S, GroupSpec, Manifest, group_backend

log = logging.getLogger(__name__)
A = TypeVar("A", bound=BaseModel)
R = TypeVar("R", bound=BaseModel)


class TrainerDied(RuntimeError):
    pass


class TrainerProcess:
    def __init__(
        self, work_dir: Path, log_path: Path, threads: int = 1, start_timeout_s: float = 120.0,
        on_event: Callable[[RunEvent], None] | None = None, device: str = "cpu", cell_gpus: tuple[int, ...] = (),
    ) -> None:
        self.work_dir = work_dir
        self.device = device  # "cpu" or "cuda:N" (gpu_runtime.proc.devices)
        self.cell_gpus = cell_gpus  # the GPUs a fsdp2 cell's ranks may take (Placement.cell_gpus)
        self.log_path = log_path
        self.threads = threads
        self.start_timeout_s = start_timeout_s
        self.on_event = on_event
        self.proc: subprocess.Popen | None = None
        self.client: RPCClient | None = None
        self.restarts = 0
        self._lock = threading.Lock()

    # ---- the typed API ------------------------------------------------------------
    def ensure_version(self, setup: RunSetup, target: int) -> VersionInfo:
        """Bring the trainer to policy version ``target`` (keep, restore + replay, or SFT)."""
        return self._call(ENSURE_VERSION, EnsureVersionCall(setup=setup, target=target))

    def train_step(self, setup: RunSetup, batch: StepBatch) -> TrainResult:
        return self._call(TRAIN_STEP, TrainStepCall(setup=setup, batch=batch))

    def checkpoint(self, setup: RunSetup, request: CheckpointRequest) -> CheckpointSaved:
        return self._call(CHECKPOINT, CheckpointCall(setup=setup, request=request))

    def restart_cells(self, setup: RunSetup, cells: list[int]) -> CellsRestarted:
        """Start lost DP cells again (``trainer.cells``); they heal from a peer at the next step."""
        return self._call(RESTART_CELLS, RestartCellsCall(setup=setup, cells=cells))

    def forget_run(self, run_id: str) -> RunForgotten:
        """A closed run: the trainer drops what it holds for it (its model, optimizer, checkpoint store)."""
        return self._call(FORGET_RUN, ForgetRunCall(run_id=run_id))

    def held_weights(self, run_id: str) -> HeldWeights:
        """The published version the trainer holds in memory (``engines.weight_sync`` distributed)."""
        return self._call(HELD_WEIGHTS, HeldWeightsCall(run_id=run_id))

    def broadcast_weights(self, call: BroadcastWeightsCall) -> WeightsBroadcast:
        """Join the push's weight-update group as rank 0 and broadcast the held version."""
        return self._call(BROADCAST_WEIGHTS, call)

    def broadcaster(self, run_id: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                    engine_devices: tuple[str, ...] = ("cpu",)) -> Broadcaster:
        """This trainer as rank 0 of a push's weight-update group, for ``fleet.update_weights``
        (``engines.weight_sync`` distributed): gloo on the CPU or colocated, NCCL when the
        engines are on other GPUs (``distributed.group_backend``)."""

        def held() -> tuple[int | None, str | None]:
            h = self.held_weights(run_id)
            return h.policy_version, h.checksum

        def send(spec: GroupSpec, manifest: Manifest, version: str, checksum: str) -> None:
            self.broadcast_weights(BroadcastWeightsCall(
                run_id=run_id, policy_version=int(version), checksum=checksum, master_address=spec.master_address,
                master_port=spec.master_port, world_size=spec.world_size, group_name=spec.group_name,
                backend=spec.backend, timeout_s=timeout_s, **manifest.as_request()))

        backend = group_backend(self.device, engine_devices)
        return Broadcaster(address="127.0.0.1", backend=backend, held=held, send=send, timeout_s=timeout_s)

    def _call(self, method: RpcMethod[A, R], arg: A) -> R:
        self.ensure_running()
        assert self.client is not None
        try:
            return self.client.call(method, arg)
        except ConnectionError as err:
            if not self.alive():
                raise TrainerDied(f"trainer pid {self.pid} died during {method.name}") from err
            raise

    # ---- the process --------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "gpu_runtime.trainer.server", "--work-dir", str(self.work_dir),
               "--threads", str(self.threads), "--parent-pid", str(os.getpid()), "--device", self.device]
        if self.cell_gpus:
            cmd += ["--cell-gpus", gpu_list(self.cell_gpus)]
        return cmd

    def start(self) -> None:
        cmd = self.command()
        try:
            self.proc, client = start_rpc_process(cmd, self.log_path, self.start_timeout_s, env=child_env(self.device))
        except ServerDidNotStart as err:
            raise TrainerDied(f"trainer did not start ({err})") from None
        if self.client is not None:  # the dead predecessor's
            self.client.close()
        self.client = client
        log.info("trainer pid %d at %s", self.proc.pid, client.base_url)

    def ensure_running(self) -> None:
        with self._lock:
            if self.alive():
                return
            old = self.proc
            self.start()
            if old is not None:
                self.restarts += 1
                TRAINER_RESTARTS.inc()
                event = TrainerRestarted(at=utc_now(), old_pid=old.pid, returncode=old.returncode, pid=self.pid)
                log.warning("trainer restarted: %s", event_text(event))
                if self.on_event is not None:
                    self.on_event(event)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_pid(self.proc.pid, self.proc)
