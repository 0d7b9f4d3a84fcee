"""What the trainer process asks of a trainer, whatever trains the run.

``Trainer`` lists exactly the calls ``TrainerService`` (and its parts: ``VersionBuilder``,
``VersionPublisher``, ``CheckpointSaver``) and ``TrainerLayouts`` make of the object
``layouts.new`` returns; each backend answers them as written: the HF ``PolicyTrainer``
(``policy``), a fsdp2 ``TrainerCell`` (``fsdp2``), a ``DPGroup`` of cells (``dp``) and the
``MegatronTrainer`` (``megatron``). A call a backend does not implement is refused with a
ValueError naming the setting (the run config refuses those settings before a run starts:
``spec.trainer.layout_conflicts``).

Where the backends differ in how they answer (a replayed step split as it committed, the
optimizer parked on the host between steps, a checkpoint's state taken as a snapshot), the
difference is the backend's own method, and ``TrainerDefaults`` holds the answer of a
backend without the capability; the service never asks which backend it holds.

Whether the trainer can take another call is an explicit state, ``health``: ``Alive``, or
``Dead`` (a fsdp2 cell that lost a rank or whose rank raised, every DP cell lost, DP cells
that diverged), which the service replaces by restore + replay. An in-process trainer is
always alive: its failures end its process.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.common.snapshot import SnapshotBuffers
from spec.train import TrainSpec

StateWriter = Callable[[Path], None]  # fills an empty folder with a checkpoint's trainer state


@dataclass(frozen=True)
class Alive:
    """The trainer answers calls."""


@dataclass(frozen=True)
class Dead:
    """The trainer cannot take another step; ``failure`` is the cell failure that ended it,
    when it was one (the fsdp2 host reports it as a run event)."""

    failure: BaseException | None = None


Health = Alive | Dead
ALIVE = Alive()


class Trainer(Protocol):
    @property
    def policy_version(self) -> int:
        """The version the trainer holds (step v makes version v; 0 is the SFT warm-up's)."""
        ...

    @property
    def health(self) -> Health: ...

    def train_step(self, samples: list[Sample], rewards: list[float], group_size: int,
                   hparams: TrainSpec, temperature: float = 1.0) -> dict[str, float]:
        """One RL update (version + 1) of the policy that sampled at ``temperature``; its metrics."""
        ...

    def replay_step(self, samples: list[Sample], rewards: list[float], group_size: int, hparams: TrainSpec,
                    temperature: float, committed: Callable[[], dict[str, float]]) -> dict[str, float]:
        """The next step again, from its stored batch (restore + replay), so that it is bitwise
        the step that committed; ``committed`` reads that step's stored metrics ({} when not
        recorded), for a backend whose split depends on who took part (DP cells)."""
        ...

    def sft_step(self, rows: list[dict], hparams: TrainSpec) -> dict[str, float]:
        """One SFT-mode update (version + 1); its metrics."""
        ...

    def save_state(self, folder: str | Path) -> None: ...

    def load_state(self, folder: str | Path) -> None: ...

    def state_writer(self, buffers: SnapshotBuffers, checksum: str | None, scratch: Path) -> StateWriter:
        """The state a checkpoint holds, taken now and written later (on the checkpoint store's
        upload thread) into an empty folder: a snapshot copied into ``buffers``, or the
        ``save_state`` folder written under ``scratch`` now and moved there then.
        ``checksum``: the version's published checksum, when the caller holds it."""
        ...

    def warm_snapshot(self, buffers: SnapshotBuffers) -> threading.Thread | None:
        """After a train step: ``buffers`` allocated in the background for the next
        ``state_writer`` (None: nothing to allocate, or this trainer takes no snapshot)."""
        ...

    def release_optimizer(self) -> None:
        """Between train steps (``engines.release_memory``): the optimizer state to the host
        and the grads freed, until ``reclaim_optimizer``."""
        ...

    def reclaim_optimizer(self) -> None:
        """Before a train step: what ``release_optimizer`` parked back on the device."""
        ...

    def export_model_folder(self, folder: str | Path) -> str:
        """This version as an HF model folder engines load; its weights' checksum."""
        ...

    def export_adapter_folder(self, folder: str | Path, base_model: str) -> None:
        """The LoRA adapters as a peft folder over ``base_model``."""
        ...

    def broadcast_tensors(self, exported: Path) -> dict[str, torch.Tensor]:
        """The version's weights for a broadcast to engines (``weight_broadcast``), as cheaply
        as this trainer holds them; ``exported`` is the folder ``export_model_folder`` wrote."""
        ...


class TrainerDefaults:
    """The answers of a backend without a capability ``Trainer`` asks about: a replay trains
    the step as ``train_step`` does, no optimizer state is parked (a fsdp2 cell's and DP
    cells' live in their processes), and a checkpoint's state is ``save_state``'s folder
    (the ranks or cells hold it), written before the call returns."""

    def replay_step(self: Trainer, samples: list[Sample], rewards: list[float], group_size: int, hparams: TrainSpec,
                    temperature: float, committed: Callable[[], dict[str, float]]) -> dict[str, float]:
        return self.train_step(samples, rewards, group_size, hparams, temperature)

    def state_writer(self: Trainer, buffers: SnapshotBuffers, checksum: str | None, scratch: Path) -> StateWriter:
        written = Path(tempfile.mkdtemp(dir=scratch, prefix="save-"))
        try:
            self.save_state(written)
        except BaseException:
            shutil.rmtree(written, ignore_errors=True)
            raise

        def move(folder: Path) -> None:
            for item in written.iterdir():
                item.rename(folder / item.name)
            shutil.rmtree(written, ignore_errors=True)
        return move

    def warm_snapshot(self, buffers: SnapshotBuffers) -> threading.Thread | None:
        return None

    def release_optimizer(self) -> None:
        pass

    def reclaim_optimizer(self) -> None:
        pass


__all__ = ["ALIVE", "Alive", "Dead", "Health", "StateWriter", "Trainer", "TrainerDefaults"]
