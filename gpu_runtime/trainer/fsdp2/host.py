"""The trainer process's side of ``trainer.backend: fsdp2``: one Ray connection and at most
one live cell. A new cell ends the previous one first (its placement group holds the
node's CPUs); ``close`` ends the cell and stops Ray by pid (or, on an existing cluster,
only disconnects). What happened to cells (one started, one failed) is kept as events the
trainer reports with its next result, and ``report`` describes the live cell for
``milestone status``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from gpu_runtime.trainer.fsdp2.cell import TrainerCell
from gpu_runtime.trainer.fsdp2.errors import CellFailed
from gpu_runtime.trainer.fsdp2.ray_runtime import RayRuntime
from gpu_runtime.trainer.protocol import Dead
from spec.events import CellFailed as CellFailedEvent, CellStarted, RunEvent, utc_now
from spec.status import CellInfo, CellRankInfo, RankState
from spec.train import TrainSpec
from spec.trainer import TrainerSpec

log = logging.getLogger(__name__)
CELL_FILE = "cell.json"
RAY_ADDRESS_ENV = "MILESTONE_RAY_ADDRESS"  # the node's existing Ray cluster (trainer.ray_address wins)


def ray_address(settings: TrainerSpec) -> str | None:
    """The existing Ray cluster to use: the run's ``trainer.ray_address``, else the node's
    $MILESTONE_RAY_ADDRESS, else None (the trainer starts its own Ray instance)."""
    return settings.ray_address or os.environ.get(RAY_ADDRESS_ENV) or None


class CellHost:
    def __init__(self, work_dir: Path, threads: int = 1, device: str = "cpu", gpus: tuple[int, ...] = ()) -> None:
        self.work_dir = work_dir
        self.threads = threads  # torch threads per rank
        self.device = device  # the trainer process's: cpu, or cuda (one GPU per rank, NCCL)
        self.gpus = gpus  # cuda: the GPUs the Ray started here may hand to ranks (empty: every GPU)
        self.ray: RayRuntime | None = None
        self.cell: TrainerCell | None = None
        self.generation = 0  # cells built by this process (a rebuilt cell is the next one)
        self.events: list[RunEvent] = []  # cell_started / cell_rank_died / ...: reported with the next result
        self.cell_file = work_dir / CELL_FILE  # the live cell's ranks and pids, for tools on this node

    def build(self, settings: TrainerSpec, folder: str | Path, hparams: TrainSpec,
              seed: int) -> TrainerCell:
        """A fresh cell of ``settings.ranks_per_cell`` ranks over the model folder."""
        self.end_cell()
        address = ray_address(settings)
        if self.ray is not None and self.ray.address != address:
            self._disconnect()
        gpus = self.gpus if self.device.startswith("cuda") and address is None else ()
        if gpus and settings.ranks_per_cell > len(gpus):
            raise ValueError(f"trainer.ranks_per_cell {settings.ranks_per_cell}: a cuda cell takes one GPU per "
                             f"rank, and this node gives cells {len(gpus)} (GPUs {list(gpus)}: the trainer's and "
                             "those no engine holds; see workers.gpu --engine-gpus)")
        if self.ray is None:
            self.ray = RayRuntime(num_cpus=settings.ranks_per_cell, address=address, gpu_ids=gpus,
                                  pid_file=self.work_dir / "ray-pids.json").start()
        self.cell = TrainerCell(settings.ranks_per_cell, folder, hparams, seed, threads=self.threads,
                                placement=settings.placement, collective_timeout_s=settings.collective_timeout_s,
                                device=self.device)
        self.generation += 1
        self.ray.record()
        state = self.report()
        assert state is not None
        log.info("fsdp2 cell %d of %d ranks: %s", self.generation, settings.ranks_per_cell,
                 [(r.pid, r.node_ip) for r in state.ranks])
        self.events.append(CellStarted(at=utc_now(), generation=self.generation, ranks=settings.ranks_per_cell,
                                       placement=settings.placement, pids=[r.pid for r in state.ranks],
                                       ray_address=address or "local"))
        tmp = self.cell_file.with_suffix(".tmp")
        tmp.write_text(state.model_dump_json())
        tmp.replace(self.cell_file)
        return self.cell

    def report(self) -> CellInfo | None:
        """The live cell (None: none): its ranks' pids and Ray nodes, as built."""
        cell = self.cell
        if cell is None or self.ray is None:
            return None
        state = RankState.FAILED if isinstance(cell.health, Dead) else RankState.ALIVE
        return CellInfo(
            generation=self.generation, placement=cell.placement, ray_address=self.ray.address or "local",
            ranks=[CellRankInfo(rank=r, pid=int(w["pid"]), node_ip=str(w["node_ip"]), node_id=str(w["node_id"]),
                                 state=state) for r, w in enumerate(cell.where)],
        )

    def failed(self, err: BaseException) -> None:
        """A call on the cell failed: remember why (an event), and on a lost Ray cluster drop
        the connection so the next call reconnects."""
        if getattr(err, "_noted", False):  # one event per failure, whichever caller sees it first
            return
        try:
            setattr(err, "_noted", True)  # noqa: B010 - an attribute BaseException does not declare
        except AttributeError:
            pass
        kind = err.kind if isinstance(err, CellFailed) else "cell_failed"
        self.events.append(CellFailedEvent(at=utc_now(), kind=kind, generation=self.generation,
                                           error_type=type(err).__name__,
                                           message=str(err).splitlines()[0] if str(err) else ""))
        if kind == "ray_unavailable":
            self.cell = None  # its actors and placement group went with the cluster
            self.cell_file.unlink(missing_ok=True)
            self._disconnect()

    def take_events(self) -> list[RunEvent]:
        out, self.events = self.events, []
        return out

    def end_cell(self) -> None:
        self.cell_file.unlink(missing_ok=True)
        if self.cell is not None:
            cell, self.cell = self.cell, None
            cell.close()

    def _disconnect(self) -> None:
        if self.ray is not None:
            ray, self.ray = self.ray, None
            ray.stop()

    def close(self) -> None:
        try:
            self.end_cell()
        finally:
            self._disconnect()


__all__ = ["CellHost", "RAY_ADDRESS_ENV", "ray_address"]
