"""``TrainingRun``'s input, the state it carries across continue-as-new, and what it reports."""

from __future__ import annotations

from pydantic import BaseModel, Field

from workflows.config import RunConfig, TrainSpec
from workflows.contracts.cells import CellHeal, CellInfo, DPCells
from workflows.contracts.events import RunEvent
from workflows.contracts.placement import DatasetInfo, ForkPoint, NodeClaim
from workflows.contracts.sampling import Sampled
from workflows.contracts.step import StepSummary
from workflows.contracts.training import EngineSlotInfo, EvalResult


class RunState(BaseModel):
    """Everything ``TrainingRun`` carries across continue-as-new."""

    next_step: int = 1
    policy_version: int = 0
    data_cursor: int = 0
    initialized: bool = False
    dataset: DatasetInfo | None = None
    node: NodeClaim | None = None
    train: TrainSpec | None = None
    paused: bool = False
    history: list[StepSummary] = []
    events: list[RunEvent] = []
    engines: list[EngineSlotInfo] = []
    cells: list[CellInfo] = []  # backend fsdp2: the node's cell, as last reported
    first_rewards: list[float] = []
    eval_before: EvalResult | None = None  # the post-SFT policy (v0) on the held-out split
    buffer: list[Sampled] = []  # batches sampled ahead for the next steps, oldest first (one_step_off, fully_async)
    prefetched: Sampled | None = None  # the one-batch buffer as carried before ``buffer`` existed (read only)
    dp: DPCells | None = None  # trainer.cells > 1: the DP cells as last reported
    cell_heal: dict[str, CellHeal] = {}  # lost DP cells awaiting their restart, by index


class TrainingRunInput(BaseModel):
    config: RunConfig
    state: RunState | None = None
    lineage: list[ForkPoint] = []  # a fork (``milestone fork``): its ancestors, oldest first; the last is its parent


class RunProgress(BaseModel):
    run_id: str
    state: str  # initializing | running | paused | completed | failed
    step: int  # last committed step
    total_steps: int
    policy_version: int
    data_cursor: int
    node_queue: str | None = None
    lineage: list[ForkPoint] = Field(default_factory=list)  # a fork: its ancestors, the last is its parent
    steps: list[StepSummary] = Field(default_factory=list)
    events: list[RunEvent] = Field(default_factory=list)
    engines: list[EngineSlotInfo] = Field(default_factory=list)
    cells: list[CellInfo] = Field(default_factory=list)  # backend fsdp2: cells and their ranks (pid, node, state)
    dp: DPCells | None = None  # trainer.cells > 1: the DP cells (pid, state, version)
    cell_heal: dict[str, CellHeal] = Field(default_factory=dict)  # lost DP cells and when each restarts
    mode: str = "rl"  # the run's config.mode: rl | sft


class RunSummary(BaseModel):
    run_id: str
    steps: int
    policy_version: int
    data_cursor: int
    first_reward_mean: float
    last_reward_mean: float
    final_weights_key: str = ""
    eval_before_greedy: float | None = None  # the post-SFT policy (v0), before any RL step
    eval_before_pass_at_k: float | None = None
    eval_step: int | None = None  # the last evaluated step and its numbers (None: never evaluated)
    eval_greedy: float | None = None
    eval_pass_at_k: float | None = None
    eval_k: int | None = None
