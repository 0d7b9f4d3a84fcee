"""The calls a fsdp2 cell's driver (``cell.TrainerCell``) makes of its ranks' trainers: one
declaration each, its name and the ``CellRankTrainer`` function that serves it.

Ray carries the call (the arguments and results are Python objects: samples, tensors),
so this is not ``spec.rpc``'s JSON transport, but the same pattern: the driver calls
through a declaration (``cell._call(TRAIN_STEP, samples, ...)``, typed by the function's
signature) and the rank's actor dispatches the name it receives from ``RANK_METHODS``, one
registration per method; a name not declared there is refused (``UnknownRankMethod``)
instead of reaching any attribute of the trainer.

A method whose first argument is a folder on the driver's machine says so (``folder``:
``"reads"`` or ``"writes"``): a rank on another machine then runs it on a stage of its own
(``folders.py``), the folder sent there first or what it wrote sent back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, Literal, ParamSpec, TypeVar

from gpu_runtime.trainer.fsdp2.rank import CellRankTrainer

P = ParamSpec("P")
R = TypeVar("R")
FolderUse = Literal["reads", "writes"]  # what a method does with the folder its first argument names


class UnknownRankMethod(KeyError):
    pass


@dataclass(frozen=True)
class RankMethod(Generic[P, R]):
    """One call every rank runs (FSDP's collectives need every rank); the driver answers rank 0's result."""

    name: str  # what travels through Ray to the rank's actor
    fn: Callable[Concatenate[CellRankTrainer, P], R]
    folder: FolderUse | None = None  # its first argument is a folder it reads or writes


def _policy_version(trainer: CellRankTrainer) -> int:
    return trainer.policy_version


TRAIN_STEP = RankMethod("train_step", CellRankTrainer.train_step)
SAVE_STATE = RankMethod("save_state", CellRankTrainer.save_state, folder="writes")
LOAD_STATE = RankMethod("load_state", CellRankTrainer.load_state, folder="reads")
CHECKSUM = RankMethod("checksum", CellRankTrainer.checksum)
PUBLISHED_STATE = RankMethod("published_state", CellRankTrainer.published_state)
EXPORT_MODEL_FOLDER = RankMethod("export_model_folder", CellRankTrainer.export_model_folder, folder="writes")
COLLECTIVE_SECONDS = RankMethod("collective_seconds", CellRankTrainer.collective_seconds)  # bench_trainer_cell
POLICY_VERSION = RankMethod("policy_version", _policy_version)  # asked of rank 0 only (no collective)

RANK_METHODS: dict[str, RankMethod] = {m.name: m for m in (
    TRAIN_STEP, SAVE_STATE, LOAD_STATE, CHECKSUM, PUBLISHED_STATE, EXPORT_MODEL_FOLDER, COLLECTIVE_SECONDS,
    POLICY_VERSION,
)}


def declared(name: str) -> RankMethod:
    """The declaration of ``name``; ``UnknownRankMethod`` when there is none."""
    method = RANK_METHODS.get(name)
    if method is None:
        raise UnknownRankMethod(f"{name!r} is not a fsdp2 rank method (declared: {sorted(RANK_METHODS)})")
    return method


def serve(trainer: CellRankTrainer, name: str, *args: Any, **kwargs: Any) -> Any:
    """The rank's side of a call: the declared method ``name`` on this rank's trainer."""
    return declared(name).fn(trainer, *args, **kwargs)


__all__ = [
    "CHECKSUM",
    "COLLECTIVE_SECONDS",
    "EXPORT_MODEL_FOLDER",
    "FolderUse",
    "LOAD_STATE",
    "POLICY_VERSION",
    "PUBLISHED_STATE",
    "RANK_METHODS",
    "SAVE_STATE",
    "TRAIN_STEP",
    "RankMethod",
    "UnknownRankMethod",
    "declared",
    "serve",
]
