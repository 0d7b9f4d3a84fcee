"""Placing a run on a node: the claim, the liveness watch, the dataset it prepares, and the trainer's
init (SFT warm-up or restore) to the committed version."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from spec.data import DataSpec
from spec.reward import RewardSpec
from spec.events import RunEvent
from spec.placement import Placed
from spec.run import EvalSpec
from spec.status import CellInfo, DPCells
from spec.trainer_rpc import RunSetup


class NodeClaim(BaseModel):
    node_id: str
    boot_id: str
    task_queue: str
    epoch: int = 0  # this placement's epoch (gpu_runtime/store/fence.py); 0: unfenced (a claim without a store)
    weights_url: str = ""  # where other nodes pull this node's trainer versions from ("": it serves none)


class FencePlacementInput(Placed):
    """Raise the run's fence to ``epoch`` (its rollout nodes changed at a step boundary): writes of
    a node the run left behind are refused from now on. ``node``: the trainer's node, as the fence
    records it; ``from_step``: the first step the new placement runs."""

    node: str
    from_step: int


class ClaimNodeInput(BaseModel):
    run_id: str
    exclude_queues: list[str] = []  # nodes the run lost: left to others for the first attempts
    store_uri: str = ""  # where the run's fence is (empty: no epoch)
    held_queues: list[str] = []  # nodes the run holds already (its trainer node, other rollout nodes): never claimed


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


class InitPolicyInput(BaseModel):
    """Bring the node's trainer to ``policy_version`` of the run it is set up with (0 on a
    fresh run: the SFT warm-up)."""

    setup: RunSetup
    policy_version: int = 0


class PolicyInfo(BaseModel):
    policy_version: int
    checksum: str
    sft_metrics: dict[str, float] = {}
    seconds: float = 0.0
    restored_from_step: int | None = None
    replayed_steps: list[int] = []
    node_events: list[RunEvent] = []
    cell: CellInfo | None = None  # backend fsdp2: the cell that holds this version
    dp: DPCells | None = None  # trainer.cells > 1: the DP cells
