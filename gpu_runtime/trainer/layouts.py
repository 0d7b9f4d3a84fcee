"""Which object trains a run, per its ``trainer`` settings, and the processes behind it.

- ``single``: one ``PolicyTrainer`` in this process.
- ``fsdp2``: a cell of FSDP2 ranks on Ray (``CellHost``: Ray and at most one live cell).
- ``cells > 1``: DP cells joined by torchft (``DPGroup``, and the torchft lighthouse,
  which outlives groups).
- ``megatron``: a megatron-core GPTModel's trainer in this process.

Each answers the calls ``TrainerService`` makes of a trainer (``protocol.Trainer``). The SFT
warm-up always runs on a single ``PolicyTrainer``; for the other layouts its post-SFT model
folder is what the run's trainer is then built from. Ray, torchft and megatron-core are
imported only when a run asks for them (optional extras: the backends import them lazily).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from gpu_runtime.trainer.dp.group import DPGroup
from gpu_runtime.trainer.dp.lighthouse import Lighthouse
from gpu_runtime.trainer.fsdp2.host import CellHost
from gpu_runtime.trainer.megatron import trainer as megatron_trainer
from gpu_runtime.trainer.megatron.trainer import MegatronTrainer
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from gpu_runtime.trainer.protocol import Dead, Trainer
from spec.events import RunEvent
from spec.status import CellInfo, DPCells
from spec.trainer_rpc import RunSetup

log = logging.getLogger(__name__)


def layout(setup: RunSetup | None) -> str:
    """``single``, ``fsdp2``, ``dp`` (trainer.cells > 1) or ``megatron``."""
    spec = setup.trainer if setup is not None else None
    if spec is None:
        return "single"
    if spec.cells > 1:
        return "dp"
    return spec.backend


class TrainerLayouts:
    def __init__(self, work_dir: Path, cell_gpus: tuple[int, ...] = ()) -> None:
        self.work_dir = work_dir
        self.cell_gpus = cell_gpus  # on CUDA: the GPUs a fsdp2 cell's ranks may take (empty: all)
        self.cell_host: CellHost | None = None  # backend fsdp2: Ray and the live cell (created on first use)
        self.dp_group: DPGroup | None = None  # trainer.cells > 1: the live DP cells
        self.lighthouse: Lighthouse | None = None  # trainer.cells > 1: torchft's lighthouse (outlives groups)
        self._dp_events: list[RunEvent] = []  # of closed groups, reported with the next result

    # ---- building ----------------------------------------------------------------
    @staticmethod
    def refuse_unservable(setup: RunSetup) -> None:
        """Refuse a run this trainer process cannot serve before it touches the run's store:
        ``trainer.backend megatron`` needs megatron-core and a CUDA trainer (a ValueError: the
        run fails as invalid input instead of retrying on the same node)."""
        if setup.trainer is not None and setup.trainer.backend == "megatron":
            if problem := megatron_trainer.runtime_problem():
                raise ValueError(problem)

    def new(self, setup: RunSetup, folder: Path) -> Trainer:
        """The run's trainer over the model folder ``folder``."""
        kind = layout(setup)
        if kind == "fsdp2":  # a cell of FSDP2 ranks on Ray
            assert setup.trainer is not None
            return self._cells().build(setup.trainer, folder, setup.hparams, setup.seed)
        if kind == "dp":  # a group of DP cells
            return self._new_dp_group(setup, folder)
        if kind == "megatron":  # a megatron-core GPTModel's trainer
            return MegatronTrainer.create(folder, setup.hparams, setup.seed)
        return PolicyTrainer.create(folder, setup.hparams, setup.seed, setup.model.lora, setup.distill)

    @staticmethod
    def sft_trainer(setup: RunSetup, base: Path) -> PolicyTrainer:
        """The trainer the SFT warm-up runs on: a single HF trainer, for every layout (a
        single run keeps it; ``after_sft`` hands the others its post-SFT weights)."""
        return PolicyTrainer.create(base, setup.hparams, setup.seed, setup.model.lora, setup.distill)

    def after_sft(self, setup: RunSetup, trainer: PolicyTrainer) -> Trainer:
        """The run's trainer after the warm-up on ``sft_trainer``'s."""
        if layout(setup) == "single":
            return trainer
        folder = self.work_dir / setup.run_id / "post-sft"
        trainer.export_model_folder(folder)
        del trainer  # one full copy at a time in this process
        return self.new(setup, folder)

    def _cells(self) -> CellHost:
        if self.cell_host is None:
            # the cell trains where this process does (``--device``): one GPU per rank on CUDA
            self.cell_host = CellHost(self.work_dir, device=torch.get_default_device().type, gpus=self.cell_gpus)
        return self.cell_host

    def _new_dp_group(self, setup: RunSetup, folder: Path) -> DPGroup:
        """Fresh DP cells over ``folder`` (the previous group's processes end first)."""
        assert setup.trainer is not None
        self.end_dp_group()
        if self.lighthouse is None:
            self.lighthouse = Lighthouse(self.work_dir / "lighthouse.log")
        self.dp_group = DPGroup(setup.trainer.cells, folder, setup.hparams, setup.seed,
                                self.work_dir / setup.run_id / "dp", self.lighthouse,
                                timeout_s=setup.trainer.collective_timeout_s)
        return self.dp_group

    # ---- failures ------------------------------------------------------------------
    def cell_failed(self, err: BaseException) -> None:
        """The fsdp2 cell failed with ``err``: its host reports it (and rebuilds it next)."""
        if self.cell_host is not None:
            self.cell_host.failed(err)

    def discard_dead(self, dead: Dead) -> None:
        """Before a call: a trainer found dead (a fsdp2 cell that lost a rank, every DP cell
        lost) is dropped; its cell's failure is reported, DP cells end."""
        if dead.failure is not None:
            self.cell_failed(dead.failure)
        self.end_dp_group()

    def step_failed(self, setup: RunSetup | None, trainer: Trainer | None, err: BaseException) -> bool:
        """After a train step raised ``err``: whether ``trainer`` must be rebuilt (restore +
        replay). A fsdp2 cell always is (a rank may have died mid-step); DP cells only when
        every cell is lost or they diverged (their group then ends)."""
        kind = layout(setup)
        if kind == "fsdp2":
            self.cell_failed(err)
            return True
        if kind == "dp" and trainer is not None and isinstance(trainer.health, Dead):
            self.end_dp_group()
            return True
        return False

    def restart_cells(self, setup: RunSetup, trainer: Trainer | None, indices: list[int]) -> dict[str, str]:
        """Start the given lost DP cells again; see ``TrainerService.restart_cells``."""
        group = self.dp_group if layout(setup) == "dp" and trainer is self.dp_group else None
        outcome: dict[str, str] = {}
        for i in indices:
            if group is None:
                outcome[str(i)] = "no_group"
                continue
            try:
                outcome[str(i)] = group.restart(i)
            except Exception as err:  # noqa: BLE001 - reported; the workflow backs off and tries again
                log.warning("restarting DP cell %d failed: %s", i, err)
                outcome[str(i)] = f"failed: {err}"
        return outcome

    # ---- reports -------------------------------------------------------------------
    def dp_state(self, setup: RunSetup | None) -> DPCells | None:
        """The DP cells (None unless trainer.cells > 1)."""
        return self.dp_group.state() if layout(setup) == "dp" and self.dp_group is not None else None

    def cell_state(self, setup: RunSetup | None) -> CellInfo | None:
        """The live fsdp2 cell's ranks (None for the other layouts)."""
        return self.cell_host.report() if layout(setup) == "fsdp2" and self.cell_host is not None else None

    def take_events(self) -> list[RunEvent]:
        """The cells' events not yet reported (fsdp2: started, failed; DP: lost, healed, ...)."""
        events = self.cell_host.take_events() if self.cell_host is not None else []
        events += self._dp_events + (self.dp_group.take_events() if self.dp_group is not None else [])
        self._dp_events = []
        return events

    # ---- ending --------------------------------------------------------------------
    def end_dp_group(self) -> None:
        if self.dp_group is not None:
            self._dp_events += self.dp_group.take_events()
            self.dp_group.close()
            self.dp_group = None

    def close(self) -> None:
        """End the cell and its Ray processes (backend fsdp2), the DP cells and their lighthouse."""
        if self.cell_host is not None:
            self.cell_host.close()
        self.end_dp_group()
        if self.lighthouse is not None:
            self.lighthouse.stop()


__all__ = ["TrainerLayouts", "layout"]
