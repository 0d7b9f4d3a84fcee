"""What the trainer process asks of a trainer, whatever trains the run.

``Trainer`` lists exactly the calls ``TrainerService`` and ``TrainerLayouts`` make of the
object ``layouts.new`` returns; each backend answers them as written: the HF
``PolicyTrainer`` (``policy``), a fsdp2 ``TrainerCell`` (``fsdp2``), a ``DPGroup`` of cells
(``dp``) and the ``MegatronTrainer`` (``megatron``). A call a backend does not implement is
refused with a ValueError naming the setting (the run config refuses those settings before
a run starts: ``spec.trainer.layout_conflicts``).

Whether the trainer can take another call is an explicit state, ``health``: ``Alive``, or
``Dead`` (a fsdp2 cell that lost a rank or whose rank raised, every DP cell lost, DP cells
that diverged), which the service replaces by restore + replay. An in-process trainer is
always alive: its failures end its process.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from gpu_runtime.store.artifacts import Sample
from spec.train import TrainSpec


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

    def sft_step(self, rows: list[dict], hparams: TrainSpec) -> dict[str, float]:
        """One SFT-mode update (version + 1); its metrics."""
        ...

    def save_state(self, folder: str | Path) -> None: ...

    def load_state(self, folder: str | Path) -> None: ...

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


__all__ = ["ALIVE", "Alive", "Dead", "Health", "Trainer"]
