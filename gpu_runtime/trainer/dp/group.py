"""The trainer process's handle on its K data-parallel cells (``trainer.cells: K``).

It answers the calls ``TrainerService`` makes of a ``PolicyTrainer`` (train_step,
save_state, load_state, export_model_folder, policy_version) by driving K cell processes
(``cell_server``) that train each step together through torchft.

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
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from pydantic import BaseModel
from safetensors.torch import load_file

from gpu_runtime.models.model_folder import WEIGHTS_FILE
from gpu_runtime.proc.rpc import RemoteError, ServerDidNotStart, start_rpc_process
from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.dp.cell_process import CellProcess, Silent, watched
from gpu_runtime.trainer.dp import cell_rpc
from gpu_runtime.trainer.dp.cell_rpc import BuildCall, CellReport, Empty, PathCall, StepInput, TrainCall
from gpu_runtime.trainer.dp.lighthouse import Lighthouse, LighthouseWatchdog
from gpu_runtime.trainer.protocol import ALIVE, Dead, Health
from spec.rpc import RpcMethod
from spec.status import DPCellStatus, DPCells, RunEvent
from spec.train import TrainSpec

log = logging.getLogger(__name__)
A = TypeVar("A", bound=BaseModel)
M = TypeVar("M", bound=BaseModel)
STRAGGLER_GRACE_S = 10.0
START_TIMEOUT_S = 120.0
YOUNG_LIGHTHOUSE_S = 3.0  # a step waits up to this long after a lighthouse (re)start for every cell's heartbeat
PASSED_THROUGH = {"FloatingPointError": FloatingPointError, "ValueError": ValueError}  # deterministic: every cell raises it


class DPCellsLost(RuntimeError):
    """Every cell of the group is lost: the trainer rebuilds from a checkpoint."""


class CellsDiverged(RuntimeError):
    """Cells that committed the same step hold different state (never retried: a bug)."""


@dataclass
class DPGroup:
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

    def __post_init__(self) -> None:
        if self.cells < 2:
            raise ValueError(f"trainer.cells must be >= 2 for a DP group, got {self.cells}")
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
                                            lambda err: self._note("lighthouse_restart_failed", str(err)))
        self._note("cells_started", f"{self.cells} DP cells, pids {[c.pid for c in self.members]}, "
                   f"lighthouse pid {self.lighthouse.pid}")

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
            c.state, c.why, c.healed_from_step = "alive", "", None
        return c.report

    def _lose(self, c: CellProcess, why: str) -> None:
        if c.state == "lost":
            return
        c.end(timeout_s=2.0)
        c.state, c.why = "lost", why
        self._note("cell_lost", f"cell {c.index} (pid {c.pid}): {why}")
        log.warning("DP cell %d lost: %s", c.index, why)

    def restart(self, index: int) -> str:
        """Start lost cell ``index`` again, in the background: the call returns at once
        ('restarting'; 'alive' / 'starting' when it was not lost) and no step waits for the
        new process. Once built it joins the next step's quorum, where it heals from a peer;
        a restart that fails leaves it lost (``cell_restart_failed``)."""
        c = self.members[index]
        with self._lock:
            if c.state in ("alive", "starting"):
                return c.state
            c.state = "starting"
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
                c.state, c.why = "lost", f"restart failed: {err}"
            self._note("cell_restart_failed", f"cell {c.index}: {err}")
            return
        if self._closed:  # the group ended while this cell was starting
            c.end()
            return
        c.restarts += 1
        self._note("cell_restarted", f"cell {c.index}: pid {old} -> {c.pid}; heals from a peer at the next step")

    def _ensure_lighthouse(self) -> None:
        if self.lighthouse.ensure_running():
            self._note("lighthouse_restarted", f"torchft lighthouse restarted as pid {self.lighthouse.pid}")

    def live(self) -> list[CellProcess]:
        with self._lock:
            return [c for c in self.members if c.state == "alive"]

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
        done = self._on_live(cell_rpc.TRAIN_STEP, call, lead=[c for c in self.live() if c.joining], quorum=True)
        for c, r in done:
            c.joining = False
            if r.healed_from_step is not None:
                c.healed_from_step = r.healed_from_step
                self._note("cell_healed", f"cell {c.index} copied v{r.policy_version - 1} from a peer "
                           f"(it held v{r.healed_from_step}) and trained v{r.policy_version} with it")
        self._check_equal(done, expect_version=self.version + 1)
        first = done[0][1]
        self.version = first.policy_version
        return {**first.metrics, "dp_cells_alive": float(len(self.live()))}

    def save_state(self, folder: str | Path) -> None:
        self._one(cell_rpc.SAVE_STATE, PathCall(path=str(folder)))

    def load_state(self, folder: str | Path) -> None:
        done = self._on_live(cell_rpc.LOAD_STATE, PathCall(path=str(folder)))
        self._check_equal(done)
        self.version = done[0][1].policy_version

    def export_model_folder(self, folder: str | Path) -> str:
        return self._one(cell_rpc.EXPORT_MODEL_FOLDER, PathCall(path=str(folder))).text

    def checksum(self) -> str:
        return self._one(cell_rpc.INFO, Empty()).state_checksum

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

    # ---- fan-out -----------------------------------------------------------------
    def _one(self, method: RpcMethod[A, M], arg: A) -> M:
        """``method`` on the first live cell (they are equal); a dead one is lost and the next
        asked, and so is a hung one (SIGSTOP), which would otherwise hold the call for its
        600 s timeout: its health check goes unanswered for ``timeout_s`` + a grace."""
        for c in self.live():
            try:
                return self._watched_call(c, method, arg)
            except ConnectionError as err:
                self._lose(c, f"died during {method.name}: {err}")
            except Silent:
                self._lose(c, f"no answer to {method.name} nor to its health check within "
                              f"{self.timeout_s + STRAGGLER_GRACE_S:.0f} s (hung or stopped)")
        raise self._all_lost(method.name)

    def _watched_call(self, c: CellProcess, method: RpcMethod[A, M], arg: A) -> M:
        """The call on a thread while this one checks the cell's /health each second (served
        by its own thread, so a long export answers it; a stopped process does not)."""
        client = c.client
        assert client is not None
        silent_since: float | None = None

        def check() -> None:
            nonlocal silent_since
            if client.healthy(timeout_s=1.0):
                silent_since = None
            elif silent_since is None:
                silent_since = time.monotonic()
            elif time.monotonic() - silent_since > self.timeout_s + STRAGGLER_GRACE_S:
                raise Silent()

        return watched(lambda: client.call(method, arg, timeout_s=max(self.timeout_s, 600.0)), check, 1.0)

    def _on_live(self, method: RpcMethod[A, CellReport], arg: A, lead: list[CellProcess] | None = None,
                 quorum: bool = False) -> list[tuple[CellProcess, CellReport]]:
        """``method`` on every live cell at once. A cell whose connection drops is lost; once one
        has answered, the others have ``timeout_s`` + a grace, then are killed and lost.

        ``lead`` (restarted cells) are called first, and the others only once the lighthouse
        holds their quorum requests: torchft forms a "fast quorum" of the previous step's
        cells as soon as they have all asked, leaving out a cell that asks a moment later
        (which would then wait for a quorum nobody else joins)."""
        cells = self.live()
        lead = [c for c in (lead or []) if c in cells]
        cells = lead + [c for c in cells if c not in lead]
        if not cells:
            raise self._all_lost(method.name)
        if lead:  # restarted cells create their torchft managers now (see ``cell_server.join``)
            lead = self._join(lead)
            cells = [c for c in cells if c.state == "alive"]  # still lead first
            if not cells:
                raise self._all_lost(method.name)
        results, errors = self._fan_out(method, arg, cells, len(lead), quorum)
        self._lose_silent(method.name, cells, results, errors)
        if not results:
            raise self._failed_everywhere(method.name, errors)
        return [(self.members[i], results[i]) for i in sorted(results)]

    def _fan_out(self, method: RpcMethod[A, CellReport], arg: A, cells: list[CellProcess], n_lead: int,
                 quorum: bool) -> tuple[dict[int, CellReport], dict[int, BaseException]]:
        """``method`` on ``cells`` (the first ``n_lead`` of them restarted ones), each on its
        own thread; the answers and errors by cell, once every cell answered or the
        stragglers' time after the first answer ran out."""
        results: dict[int, CellReport] = {}
        errors: dict[int, BaseException] = {}
        cond = threading.Condition()

        def run(c: CellProcess) -> None:
            assert c.client is not None
            try:
                r = c.client.call(method, arg)
                with cond:
                    results[c.index] = r
            except BaseException as err:  # noqa: BLE001 - sorted out by the caller
                with cond:
                    errors[c.index] = err
            with cond:
                cond.notify_all()

        threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in cells]
        if n_lead:  # a lone newcomer forms a quorum of its own when the lighthouse hears only it
            self._wait_status(self.lighthouse.heartbeating, len(cells), "heartbeating")
        elif quorum and self.lighthouse.age_s() < YOUNG_LIGHTHOUSE_S:
            self._wait_status(self.lighthouse.heartbeating, len(cells), "heartbeating",
                              timeout_s=YOUNG_LIGHTHOUSE_S - self.lighthouse.age_s())
        for i, t in enumerate(threads):
            if n_lead and i == n_lead:
                self._wait_status(self.lighthouse.pending_requests, n_lead, "waiting for a quorum")
            t.start()
        deadline: float | None = None
        with cond:
            while len(results) + len(errors) < len(cells):
                if results and deadline is None:
                    deadline = time.monotonic() + self.timeout_s + STRAGGLER_GRACE_S
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                if deadline is not None and wait == 0.0:
                    break
                cond.wait(timeout=wait if wait is not None else 1.0)
        return results, errors

    def _lose_silent(self, method: str, cells: list[CellProcess], results: dict[int, CellReport],
                     errors: dict[int, BaseException]) -> None:
        """The cells of a fan-out that did not answer in time, died, or could not heal: lost."""
        for c in cells:
            if c.index in results:
                continue
            err = errors.get(c.index)
            if err is None:
                self._lose(c, f"no answer to {method} within {self.timeout_s + STRAGGLER_GRACE_S:.0f} s of its "
                              "peers (hung or stopped)")
            elif isinstance(err, ConnectionError) or (c.proc is not None and c.proc.poll() is not None):
                self._lose(c, f"died during {method}: {err}")
            elif isinstance(err, RemoteError) and err.error_type == "NotHealed":  # restarted again by the run
                self._lose(c, f"not healed: {err.message}")

    def _failed_everywhere(self, method: str, errors: dict[int, BaseException]) -> BaseException:
        """What a fan-out no cell answered raises: the input's error every cell raised (the
        cells are fine), another cell error, or ``DPCellsLost``."""
        passed = [e for e in errors.values() if isinstance(e, RemoteError) and e.error_type in PASSED_THROUGH]
        if passed and self.live():  # the cells are fine: the input is not (every cell raises it)
            return PASSED_THROUGH[passed[0].error_type](passed[0].message)
        other = next((e for e in errors.values() if isinstance(e, RemoteError)), None)
        if other is not None and self.live():
            return RuntimeError(f"DP cells: {method}: {other}")
        return self._all_lost(method)

    def _join(self, cells: list[CellProcess]) -> list[CellProcess]:
        """``join`` on each restarted cell (its torchft manager connects to the lighthouse and
        heartbeats); those it fails for are lost."""
        joined = []
        for c in cells:
            assert c.client is not None
            try:
                c.report = c.client.call(cell_rpc.JOIN, Empty(), timeout_s=START_TIMEOUT_S)
                joined.append(c)
            except (ConnectionError, RemoteError) as err:
                self._lose(c, f"could not join torchft: {err}")
        return joined

    def _wait_status(self, count: Callable[[], int], n: int, what: str, timeout_s: float = 60.0) -> None:
        """Until the lighthouse's /status page counts ``n`` cells ``what``; after ``timeout_s``
        go on anyway (a cell that cannot heal then refuses the step: ``NotHealed``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if count() >= n:
                return
            time.sleep(0.02)
        log.warning("the lighthouse did not count %d cell(s) %s within %.0f s", n, what, timeout_s)

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
            self._note("checksum_mismatch", detail)
            self.health = Dead()
            expected = "" if expect_version is None else f" (expected v{expect_version})"
            raise CellsDiverged(f"DP cells hold different state after the same step{expected}: {detail}")
        for c, r in done:
            c.report = r

    # ---- reporting ---------------------------------------------------------------
    def _note(self, kind: str, detail: str) -> None:
        with self._lock:  # a restart thread notes too
            self.events.append(RunEvent.now(kind, detail))

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
