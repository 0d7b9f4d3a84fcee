"""A DP cell's RPC: its messages and its methods (``CELL_RPC``), which the group
(``dp.group``) calls and the cell's server (``dp.cell_server``) registers one handler for
each. Torch-free, so the group's side imports no cell trainer."""

from __future__ import annotations

from pydantic import BaseModel

from gpu_runtime.store.artifacts import Sample
from spec.rpc import MethodTable, RpcMethod
from spec.train import TrainSpec


class BuildCall(BaseModel):
    folder: str  # the HF model folder every cell starts from (a restarted one heals from a peer)
    hparams: TrainSpec
    seed: int
    join: bool = True  # create the torchft manager now (it heartbeats the lighthouse from then on)


class PathCall(BaseModel):
    path: str


class Empty(BaseModel):
    pass


class StepInput(BaseModel):
    """One step's samples and rewards, written once by the group for all its cells."""

    samples: list[Sample]
    rewards: list[float]
    group_size: int
    hparams: TrainSpec
    temperature: float = 1.0  # rollout.temperature (``StepBatch.temperature``)


class TrainCall(BaseModel):
    input_path: str  # a ``StepInput`` JSON file
    forced_participants: int | None = None  # replay of a step fewer cells committed
    from_version: int | None = None  # the version every cell must hold (or heal to) before the step


class CellReport(BaseModel):
    index: int
    pid: int
    policy_version: int
    state_checksum: str  # weights + AdamW + schedule + version
    healed_from_step: int | None = None  # this call's quorum copied a peer's state (from this version)
    metrics: dict[str, float] = {}
    seconds: float = 0.0


class Text(BaseModel):
    text: str


# the names are the wire's (``POST /call/<name>``)
BUILD = RpcMethod("build", BuildCall, CellReport)  # the cell's trainer, and (``join``) its torchft manager
JOIN = RpcMethod("join", Empty, CellReport)  # a restarted cell joins at the start of its first step
LOAD_STATE = RpcMethod("load_state", PathCall, CellReport)
TRAIN_STEP = RpcMethod("train_step", TrainCall, CellReport)
SAVE_STATE = RpcMethod("save_state", PathCall, CellReport)
EXPORT_MODEL_FOLDER = RpcMethod("export_model_folder", PathCall, Text)  # the folder's weights checksum
INFO = RpcMethod("info", Empty, CellReport)

CELL_RPC = MethodTable("DP cell RPC", BUILD, JOIN, LOAD_STATE, TRAIN_STEP, SAVE_STATE, EXPORT_MODEL_FOLDER, INFO)

__all__ = [
    "BUILD", "CELL_RPC", "EXPORT_MODEL_FOLDER", "INFO", "JOIN", "LOAD_STATE", "SAVE_STATE", "TRAIN_STEP",
    "BuildCall", "CellReport", "Empty", "PathCall", "StepInput", "Text", "TrainCall",
]
