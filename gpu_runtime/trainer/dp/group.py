"""The trainer process's handle on its K data-parallel cells (``trainer.cells: K``).

It answers the calls ``TrainerService`` makes of a trainer (``protocol.Trainer``: train_step,
replay_step, save_state, load_state, export_model_folder, policy_version) by driving K cell
processes (``cell_server``) that train each step together through torchft; it starts,
restarts and loses them, and asks them through ``CellFanOut`` (``dp.fan_out``).

- A step goes to every live cell at once. A cell that dies mid-step (its RPC connection
  drops) is *lost*; its peers' allreduce fails, their commit vote fails, and they run the
  step again in a quorum without it (``cell_trainer``). A cell that hangs (SIGSTOP) stops
  heartbeating; its peers' allreduce times out after ``timeout_s``, they commit without it,
  and once one cell has answered the others get ``timeout_s`` plus a grace before they are
  SIGKILLed by pid and lost. An export or a save asks one cell: one whose /health goes
  unanswered for ``timeout_s`` plus the grace meanwhile is lost the same way, the next asked.
- After a step every answering cell reports its state checksum (weights + AdamW + schedule
  + version); a difference raises ``CellsDiverged`` naming the cells.
- A lost cell stays lost until ``restart`` (the workflow calls it on its backoff schedule),
  which starts the new process in the background; once built it joins the next step's
  quorum and copies its state from a peer first. No step waits for a restart.
- When every cell is lost the group is ``dead``: the service rebuilds from a checkpoint.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from gpu_runtime.models.model_folder import WEIGHTS_FILE
from gpu_runtime.proc.rpc import ServerDidNotStart, start_rpc_process
from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.dp.cell_process import CellProcess
from gpu_runtime.trainer.dp import cell_rpc
from gpu_runtime.trainer.dp.cell_rpc import BuildCall, CellReport, Empty, PathCall, StepInput, TrainCall
from gpu_runtime.trainer.dp.fan_out import START_TIMEOUT_S, CellFanOut
from gpu_runtime.trainer.dp.lighthouse import Lighthouse, LighthouseWatchdog
from gpu_runtime.trainer.protocol import ALIVE, Dead, Health, TrainerDefaults
from spec.events import (
    CellHealed, CellLost, CellRestarted, CellRestartFailed, CellsDiverged as CellsDivergedEvent, CellsStarted,
    CellVersion, LighthouseRestarted, LighthouseRestartFailed, RunEvent, utc_now,
)
from spec.status import CellState, DPCellStatus, DPCells
from spec.train import TrainSpec

log = logging.getLogger(__name__)


class DPCellsLost(RuntimeError):
    """Every cell of the group is lost: the trainer rebuilds from a checkpoint."""


class CellsDiverged(RuntimeError):
    """Cells that committed the same step hold different state (never retried: a bug)."""


@dataclass
class DPGroup(TrainerDefaults):
    cells: int
    folder: Path  # the HF folder every cell (and every restarted one) is built from
    hparams: TrainSpec
    seed: int
    work_dir: Path
    lighthouse: Lighthouse
    timeout_s: float = 120.0
    threads: int = 1
    members: list[CellProcess] = field(default_factory=list)
    events: list[RunEvent] = field(default_factory=list)
    version: int = 0
    health: Health = ALIVE  # Dead: every cell lost, or the cells diverged
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _restarts: list[threading.Thread] = field(default_factory=list)
    _closed: bool = False
    _watchdog: LighthouseWatchdog | None = None
    calls: CellFanOut = field(init=False, repr=False)  # on one cell, or on every live cell at once

    def __post_init__(self) -> None:
        if self.cells < 2:
            raise ValueError(f"trainer.cells must be >= 2 for a DP group, got {self.cells}")
        self.calls = CellFanOut(self.lighthouse, self.timeout_s, self.live, self._lose, self._all_lost)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.lighthouse.ensure_running()
        self.members = [CellProcess(i) for i in range(self.cells)]
        try:
            with ThreadPoolExecutor(self.cells) as pool:
                reports = list(pool.map(self._start, self.members))
        except BaseException:
            self.close()
            raise
        self.version = reports[0].policy_version
        self._watchdog = LighthouseWatchdog(self._ensure_lighthouse,
                                            lambda err: self._note(LighthouseRestartFailed(at=utc_now(), error=str(err))))
        self._note(CellsStarted(at=utc_now(), pids=[c.pid for c in self.members], lighthouse_pid=self.lighthouse.pid))

    # ---- processes ---------------------------------------------------------------
    def _start(self, c: CellProcess, joining: bool = False) -> CellReport:
        cmd = [sys.executable, "-m", "gpu_runtime.trainer.dp.cell_server", "--index", str(c.index),
               "--lighthouse", self.lighthouse.address, "--timeout-s", str(self.timeout_s),
               "--threads", str(self.threads), "--parent-pid", str(os.getpid())]
        try:
            c.proc, client = start_rpc_process(cmd, self.work_dir / f"cell{c.index}.log", START_TIMEOUT_S)
        except ServerDidNotStart as err:
            raise RuntimeError(f"DP cell {c.index} did not start ({err})") from None
        if c.client is not None:
            c.client.close()
        c.client = client
        c.report = c.client.call(cell_rpc.BUILD, BuildCall(folder=str(self.folder), hparams=self.hparams,
                                                           seed=self.seed, join=not joining), timeout_s=START_TIMEOUT_S)
        with self._lock:  # a restarted cell is visible to steps only with its joining mark
            c.joining = joining
            c.state, c.why, c.healed_from_step = CellState.ALIVE, "", None
        return c.report

    def _lose(self, c: CellProcess, why: str) -> None:
        if c.state == CellState.LOST:
            return
        c.end(timeout_s=2.0)
        c.state, c.why = CellState.LOST, why
        self._note(CellLost(at=utc_now(), cell=c.index, pid=c.pid, why=why))
        log.warning("DP cell %d lost: %s", c.index, why)

    def restart(self, index: int) -> str:
        """Start lost cell ``index`` again, in the background: the call returns at once
        ('restarting'; 'alive' / 'starting' when it was not lost) and no step waits for the
        new process. Once built it joins the next step's quorum, where it heals from a peer;
        a restart that fails leaves it lost (``cell_restart_failed``)."""
        c = self.members[index]
        with self._lock:
            if c.state in (CellState.ALIVE, CellState.STARTING):
                return c.state
            c.state = CellState.STARTING
        t = threading.Thread(target=self._restart, args=(c,), name=f"restart-cell{index}", daemon=True)
        self._restarts.append(t)
        t.start()
        return "restarting"

    def _restart(self, c: CellProcess) -> None:
        old = c.pid
        try:  # built without its torchft manager: it joins at the start of its first step (``_join``)
            self._start(c, joining=True)
        except BaseException as err:  # noqa: BLE001 - reported; the workflow backs off and tries again
            c.end()
            with self._lock:
                c.state, c.why = CellState.LOST, f"restart failed: {err}"
            self._note(CellRestartFailed(at=utc_now(), cell=c.index, error=str(err)))
            return
        if self._closed:  # the group ended while this cell was starting
            c.end()
            return
        c.restarts += 1
        self._note(CellRestarted(at=utc_now(), cell=c.index, old_pid=old, pid=c.pid))

    def _ensure_lighthouse(self) -> None:
        if self.lighthouse.ensure_running():
            self._note(LighthouseRestarted(at=utc_now(), pid=self.lighthouse.pid))

    def live(self) -> list[CellProcess]:
        with self._lock:
            return [c for c in self.members if c.state == CellState.ALIVE]

    # ---- the calls a trainer answers ---------------------------------------------
    def train_step(self, samples: list[Sample], rewards: list[float], group_size: int,
                   hparams: TrainSpec, temperature: float = 1.0,
                   forced_participants: int | None = None) -> dict[str, float]:
        self._ensure_lighthouse()
        path = self.work_dir / "step-input.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(StepInput(samples=samples, rewards=rewards, group_size=group_size,
                                 hparams=hparams, temperature=temperature).model_dump_json())
        tmp.replace(path)
        call = TrainCall(input_path=str(path), forced_participants=forced_participants, from_version=self.version)
        done = self.calls.on_live(cell_rpc.TRAIN_STEP, call, lead=[c for c in self.live() if c.joining], quorum=True)
        for c, r in done:
            c.joining = False
            if r.healed_from_step is not None:
                c.healed_from_step = r.healed_from_step
                self._note(CellHealed(at=utc_now(), cell=c.index, held_version=r.healed_from_step,
                                      copied_version=r.policy_version - 1, trained_version=r.policy_version))
        self._check_equal(done, expect_version=self.version + 1)
        first = done[0][1]
        self.version = first.policy_version
        return {**first.metrics, "dp_cells_alive": float(len(self.live()))}

    def replay_step(self, samples: list[Sample], rewards: list[float], group_size: int, hparams: TrainSpec,
                    temperature: float, committed: Callable[[], dict[str, float]]) -> dict[str, float]:
        """The step over as many cells as committed it (its result's ``dp_cells``): a step a
        lost cell left to fewer cells sums its micro-batches differently, so its replay is
        bitwise the original only split the same way."""
        return self.train_step(samples, rewards, group_size, hparams, temperature,
                               forced_participants=self.committed_cells(committed()))

    @staticmethod
    def committed_cells(metrics: dict[str, float]) -> int | None:
        """How many cells committed a step, from its metrics (None: not recorded)."""
        cells = metrics.get("dp_cells")
        return int(cells) if cells else None

    def save_state(self, folder: str | Path) -> None:
        self.calls.one(cell_rpc.SAVE_STATE, PathCall(path=str(folder)))

    def load_state(self, folder: str | Path) -> None:
        done = self.calls.on_live(cell_rpc.LOAD_STATE, PathCall(path=str(folder)))
        self._check_equal(done)
        self.version = done[0][1].policy_version

    def export_model_folder(self, folder: str | Path) -> str:
        return self.calls.one(cell_rpc.EXPORT_MODEL_FOLDER, PathCall(path=str(folder))).text

    def checksum(self) -> str:
        return self.calls.one(cell_rpc.INFO, Empty()).state_checksum

    @property
    def policy_version(self) -> int:
        return self.version

    def sft_step(self, rows: list[dict], hparams: TrainSpec) -> dict[str, float]:
        raise ValueError("trainer.cells > 1 does not support mode sft (the cells train the RL step only)")

    def export_adapter_folder(self, folder: str | Path, base_model: str) -> None:
        raise ValueError("export_adapter_folder: DP cells (trainer.cells > 1) train no LoRA adapters")

    def broadcast_tensors(self, exported: Path) -> dict[str, torch.Tensor]:
        """The weights live in the cells' processes: the folder exported for the version
        (the page cache still holds it)."""
        return load_file(str(exported / WEIGHTS_FILE))

    def _all_lost(self, method: str) -> DPCellsLost:
        failure = DPCellsLost(f"every DP cell is lost ({method}): "
                              + "; ".join(f"cell {c.index}: {c.why}" for c in self.members))
        self.health = Dead(failure)
        return failure

    def _check_equal(self, done: list[tuple[CellProcess, CellReport]], expect_version: int | None = None) -> None:
        """Every answering cell holds the same state (and, after a step, the next version)."""
        sums = {(r.policy_version, r.state_checksum) for _, r in done}
        if len(sums) > 1 or (expect_version is not None and done[0][1].policy_version != expect_version):
            detail = ", ".join(f"cell {c.index}: v{r.policy_version} {r.state_checksum[:12]}" for c, r in done)
            self._note(CellsDivergedEvent(at=utc_now(), expected_version=expect_version, cells=[
                CellVersion(cell=c.index, version=r.policy_version, state_checksum=r.state_checksum) for c, r in done]))
            self.health = Dead()
            expected = "" if expect_version is None else f" (expected v{expect_version})"
            raise CellsDiverged(f"DP cells hold different state after the same step{expected}: {detail}")
        for c, r in done:
            c.report = r

    # ---- reporting ---------------------------------------------------------------
    def _note(self, event: RunEvent) -> None:
        with self._lock:  # a restart thread notes too
            self.events.append(event)

    def take_events(self) -> list[RunEvent]:
        with self._lock:
            out, self.events = self.events, []
        return out

    def state(self) -> DPCells:
        return DPCells(
            lighthouse_pid=self.lighthouse.pid or 0, lighthouse_restarts=self.lighthouse.restarts,
            cells=[DPCellStatus(index=c.index, pid=c.pid or 0, state=c.state, why=c.why, restarts=c.restarts,
                              policy_version=c.report.policy_version if c.report else 0,
                              state_checksum=c.report.state_checksum if c.report else "",
                              healed_from_step=c.healed_from_step) for c in self.members],
        )

    def close(self) -> None:
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.stop()
        for t in self._restarts:
            t.join(timeout=START_TIMEOUT_S)
        for c in self.members:
            c.end(timeout_s=5.0)
            if c.client is not None:
                c.client.close()
