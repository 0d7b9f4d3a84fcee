"""``TrainingRun``'s input, the state it carries across continue-as-new (and its commit
after each step), and what it reports."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from spec.run import RunConfig
from spec.events import RunEvent
from spec.status import CellInfo, DPCells, EngineSlotInfo
from spec.train import TrainSpec
from spec.trainer import TrainerSpec
from spec.trainer_rpc import ForkPoint
from workflows import cell_heal
from workflows.contracts.cells import CellHeal
from workflows.contracts.placement import DatasetInfo, NodeClaim
from workflows.contracts.sampling import Sampled
from workflows.contracts.step import StepSummary
from workflows.contracts.training import EvalResult

HISTORY_KEEP = 200  # step summaries the state keeps (the progress query lists them)
EVENTS_KEEP = 100  # run events the state keeps
SUMMARY_STEPS = 5  # the run's summary compares the mean reward of its first and last 5 steps


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
    dp: DPCells | None = None  # trainer.cells > 1: the DP cells as last reported
    cell_heal: dict[str, CellHeal] = {}  # lost DP cells awaiting their restart, by index
    num_engines: int | None = None  # ``set_engines``: the engine count per node from the next step (None: the config's)
    num_nodes: int | None = None  # ``set_engines``: the rollout nodes from the next step (None: engines.nodes)
    rollout_nodes: list[NodeClaim] = []  # engines.nodes > 0: the rollout nodes the run holds, in slot order
    checksum: str = ""  # the committed version's weight checksum (what a joining rollout node must serve)

    def commit(self, summary: StepSummary, now: datetime, trainer: TrainerSpec) -> RunState:
        """The state once ``summary``'s step has committed (at workflow time ``now``): the only
        place the data cursor and the policy version move. Pure: ``self`` is left as it is."""
        dp_reported = summary.dp is not None or bool(summary.cell_restarts)  # trainer.cells > 1
        return self.model_copy(update={
            "policy_version": summary.policy_version,
            "checksum": summary.checksum or self.checksum,
            "data_cursor": summary.data_cursor,
            "buffer": summary.next_buffer,  # one_step_off / fully_async: the next steps' batches, already sampled
            "history": [*self.history, summary.model_copy(update={
                "events": [], "engines": [], "cell": None, "next_buffer": [], "dp": None,
            })][-HISTORY_KEEP:],
            "events": [*self.events, *summary.events][-EVENTS_KEEP:],
            "engines": summary.engines,
            "cells": [summary.cell] if summary.cell is not None else [],
            "dp": (summary.dp or self.dp) if dp_reported else self.dp,
            # the lost cells' restarts, scheduled
            "cell_heal": (cell_heal.after_step(self.cell_heal, summary.dp, summary.cell_restarts, now, trainer)
                          if dp_reported else self.cell_heal),
            "first_rewards": (self.first_rewards if len(self.first_rewards) >= SUMMARY_STEPS
                              else [*self.first_rewards, summary.reward_mean]),
            "next_step": self.next_step + 1,
        })

    def add_events(self, events: list[RunEvent]) -> None:
        """Append ``events``, keeping the last ``EVENTS_KEEP``."""
        self.events = [*self.events, *events][-EVENTS_KEEP:]

    def last_evaluated(self) -> StepSummary | None:
        """The newest step that carries eval numbers."""
        return next((s for s in reversed(self.history) if s.eval_greedy is not None), None)

    def summary(self, run_id: str) -> RunSummary:
        """What the finished run returns."""
        last = self.history[-SUMMARY_STEPS:]
        evaluated = self.last_evaluated()
        before = self.eval_before
        return RunSummary(
            run_id=run_id,
            steps=self.next_step - 1,
            policy_version=self.policy_version,
            data_cursor=self.data_cursor,
            first_reward_mean=sum(self.first_rewards) / max(1, len(self.first_rewards)),
            last_reward_mean=sum(s.reward_mean for s in last) / max(1, len(last)),
            final_weights_key=self.history[-1].weights_key if self.history else "",
            eval_before_greedy=before.greedy_accuracy if before else None,
            eval_before_pass_at_k=before.pass_at_k if before else None,
            eval_before_sampled=before.sampled_accuracy if before else None,
            eval_step=evaluated.step if evaluated else None,
            eval_greedy=evaluated.eval_greedy if evaluated else None,
            eval_pass_at_k=evaluated.eval_pass_at_k if evaluated else None,
            eval_sampled=evaluated.eval_sampled if evaluated else None,
            eval_k=evaluated.eval_k if evaluated else None,
        )


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
    trainer_node: NodeClaim | None = None  # the claim of the node that trains (its queue is node_queue)
    rollout_nodes: list[NodeClaim] = Field(default_factory=list)  # engines.nodes > 0: the nodes that generate
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
    eval_before_sampled: float | None = None
    eval_step: int | None = None  # the last evaluated step and its numbers (None: never evaluated)
    eval_greedy: float | None = None
    eval_pass_at_k: float | None = None
    eval_sampled: float | None = None  # pass@1 at the eval temperature
    eval_k: int | None = None
