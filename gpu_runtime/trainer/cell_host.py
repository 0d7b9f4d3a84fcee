"""The trainer process's side of ``trainer.backend: fsdp2``: one local Ray instance and at
most one live cell. A new cell ends the previous one first (its placement group holds the
node's CPUs); ``close`` ends the cell and stops Ray by pid."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from gpu_runtime.trainer.api import TrainerBackendSettings, TrainerHParams
from gpu_runtime.trainer.cell import RayRuntime, TrainerCell

log = logging.getLogger(__name__)
CELL_FILE = "cell.json"


class CellHost:
    def __init__(self, work_dir: Path, threads: int = 1) -> None:
        self.work_dir = work_dir
        self.threads = threads  # torch threads per rank
        self.ray: RayRuntime | None = None
        self.cell: TrainerCell | None = None
        self.cell_file = work_dir / CELL_FILE  # the live cell's ranks and pids, for tools and tests

    def build(self, settings: TrainerBackendSettings, folder: str | Path, hparams: TrainerHParams,
              seed: int) -> TrainerCell:
        """A fresh cell of ``settings.ranks_per_cell`` ranks over the model folder."""
        self.end_cell()
        if self.ray is None:
            self.ray = RayRuntime(num_cpus=settings.ranks_per_cell, pid_file=self.work_dir / "ray-pids.json").start()
        self.cell = TrainerCell(settings.ranks_per_cell, folder, hparams, seed, threads=self.threads)
        pids = self.cell.pids()
        self.ray.record()
        log.info("fsdp2 cell of %d ranks: pids %s", settings.ranks_per_cell, pids)
        tmp = self.cell_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"ranks": [{"rank": r, "pid": p} for r, p in enumerate(pids)],
                                   "strategy": "STRICT_PACK", "node_ip": "127.0.0.1"}))
        tmp.replace(self.cell_file)
        return self.cell

    def end_cell(self) -> None:
        self.cell_file.unlink(missing_ok=True)
        if self.cell is not None:
            cell, self.cell = self.cell, None
            cell.close()

    def close(self) -> None:
        try:
            self.end_cell()
        finally:
            if self.ray is not None:
                ray, self.ray = self.ray, None
                ray.stop()


__all__ = ["CellHost"]
