"""Placing a run on a node: the claim, the liveness watch, the dataset it prepares, and the trainer's
init (SFT warm-up or restore) to the committed version."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from spec.data import DataSpec
from spec.model import DistillSpec, ModelSpec
from spec.reward import RewardSpec
from spec.run import CheckpointSpec, EvalSpec
from spec.status import CellInfo, DPCells, RunEvent
from spec.train import SFTSpec, TrainSpec
from spec.trainer import TrainerSpec
from spec.trainer_rpc import ForkPoint


class Placed(BaseModel):
    """The placement context of a node activity's work: the run, its store, and the placement
    epoch it runs under. Every write goes to the store at that epoch, so a step of a placement
    the run has left behind writes nothing (the store refuses older epochs; 0: unfenced)."""

    run_id: str
    store_uri: str
    epoch: int = 0


class NodeClaim(BaseModel):
    node_id: str
    boot_id: str
    task_queue: str
    epoch: int = 0  # this placement's epoch (gpu_runtime/store/fence.py); 0: unfenced (a claim without a store)


class ClaimNodeInput(BaseModel):
    run_id: str
    exclude_queues: list[str] = []
    store_uri: str = ""  # where the run's fence is (empty: no epoch)


class NodeLivenessInput(BaseModel):
    run_id: str
    interval_s: float  # heartbeat this often until cancelled


class PrepareDataInput(BaseModel):
    run_id: str
    store_uri: str
    seed: int
    data: DataSpec
    mode: Literal["rl", "sft"] = "rl"  # sft: no reward, so labels need no integer answer
    reward: RewardSpec = Field(default_factory=RewardSpec)  # math_answer: every label needs an integer answer
    eval: EvalSpec = Field(default_factory=EvalSpec)  # enabled: also write the held-out split (n rows at most)


class DatasetInfo(BaseModel):
    key: str
    n_rows: int
    sha256: str
    eval_key: str | None = None  # the held-out split; None: no eval (disabled, no data.eval_path, or a run before evals)
    n_eval: int = 0


class InitPolicyInput(Placed):
    seed: int
    model: ModelSpec
    sft: SFTSpec
    train: TrainSpec
    dataset: DatasetInfo
    checkpoint: CheckpointSpec
    config_hash: str
    policy_version: int = 0  # bring the trainer to this version (0 on a fresh run: SFT warm-up)
    distill: DistillSpec | None = None  # on-policy distillation: the trainer loads the teacher
    lineage: list[ForkPoint] = []  # a fork: where the steps before its own live (oldest first)
    trainer: TrainerSpec = TrainerSpec()  # single process, or a fsdp2 cell of ranks


class PolicyInfo(BaseModel):
    policy_version: int
    checksum: str
    weights_key: str
    sft_metrics: dict[str, float] = {}
    seconds: float = 0.0
    restored_from_step: int | None = None
    replayed_steps: list[int] = []
    node_events: list[RunEvent] = []
    cell: CellInfo | None = None  # backend fsdp2: the cell that holds this version
    dp: DPCells | None = None  # trainer.cells > 1: the DP cells
