"""The seam between workflow contracts and the GPU runtime's own models.

One named function per crossing, in both directions. The models mirrored on the
two sides are listed in ``MIRRORS``; ``tests/unit/test_translate.py`` checks their
field sets agree, so neither side can grow a field the other silently drops.
"""

from __future__ import annotations

from datetime import datetime, timezone

from pydantic import BaseModel

from gpu_runtime.data.readers import DataSource
from gpu_runtime.data.rewards import RewardSettings, RewardTermSettings
from gpu_runtime.engine.fleet_types import SlotInfo
from gpu_runtime.rollout.evaluate import EvalRequest, EvalStats
from gpu_runtime.rollout.request import AgentSettings, RolloutRequest
from gpu_runtime.trainer.api import (
    Ancestor,
    BatchSelection,
    CellsRestarted,
    CellState,
    CheckpointRequest,
    CheckpointSaved,
    DistillSettings,
    DPState,
    LoraSettings,
    ModelInit,
    ModelSource,
    NodeEvent,
    Rebuild,
    RunSetup,
    SFTRows,
    SFTSettings,
    StepBatch,
    TrainerBackendSettings,
    TrainerHParams,
    TrainResult,
    VersionInfo,
)
from workflows.agent_config import AgentSpec
from workflows.trainer_config import TrainerSpec
from workflows.config import DataSpec, DistillSpec, LoraSpec, ModelInitSpec, ModelSpec, RewardSpec, RewardTerm, SFTSpec, TrainSpec
from workflows.contracts.cells import CellInfo, CellRankInfo, DPCells, DPCellStatus, RestartCellsResult
from workflows.contracts.events import RunEvent
from workflows.contracts.placement import InitPolicyInput, PolicyInfo
from workflows.contracts.sampling import RolloutInput
from workflows.contracts.training import (
    CheckpointInput,
    CheckpointResult,
    EngineSlotInfo,
    EvalInput,
    EvalResult,
    TrainStepInput,
    TrainStepResult,
)

# (run config section, runtime model): the same fields on both sides
MIRRORS: list[tuple[type[BaseModel], type[BaseModel]]] = [
    (TrainSpec, TrainerHParams),
    (SFTSpec, SFTSettings),
    (ModelSpec, ModelSource),
    (ModelInitSpec, ModelInit),
    (LoraSpec, LoraSettings),
    (DistillSpec, DistillSettings),
    (RewardSpec, RewardSettings),
    (RewardTerm, RewardTermSettings),
    (DataSpec, DataSource),
    (AgentSpec, AgentSettings),
    (TrainerSpec, TrainerBackendSettings),
]


# ---- workflow -> runtime -------------------------------------------------------------
def trainer_hparams(train: TrainSpec) -> TrainerHParams:
    return TrainerHParams.model_validate(train.model_dump())


def reward_settings(reward: RewardSpec) -> RewardSettings:
    """Field for field, with each kind-specific field at its default for the kind."""
    return RewardSettings.model_validate(reward.resolved())


def data_source(data: DataSpec) -> DataSource:
    """(``milestone start``'s pre-flight does the same without importing this module, which imports torch.)"""
    return DataSource.model_validate(data.model_dump())


def run_setup(inp: InitPolicyInput, node_id: str = "") -> RunSetup:
    return RunSetup(
        run_id=inp.run_id,
        store_uri=inp.store_uri,
        seed=inp.seed,
        model=ModelSource.model_validate(inp.model.model_dump()),
        sft=SFTSettings.model_validate(inp.sft.model_dump()),
        hparams=trainer_hparams(inp.train),
        dataset_key=inp.dataset.key,
        keep_last=inp.checkpoint.keep_last,
        config_hash=inp.config_hash,
        distill=None if inp.distill is None else DistillSettings.model_validate(inp.distill.model_dump()),
        lineage=[Ancestor(run_id=a.run_id, step=a.step) for a in inp.lineage],
        epoch=inp.epoch,
        node_id=node_id,
        trainer=TrainerBackendSettings.model_validate(inp.trainer.model_dump()),
    )


def step_batch(inp: TrainStepInput) -> StepBatch:
    rows = inp.sft_rows
    # the selection's fields are the same on both sides; the trainer's model forbids extras
    selection = None if inp.selection is None else BatchSelection.model_validate(inp.selection.model_dump())
    return StepBatch(
        step=inp.step, policy_version=inp.policy_version, chunk_keys=inp.chunk_keys,
        rewards_key=inp.rewards_key, group_size=inp.group_size, hparams=trainer_hparams(inp.train),
        sft=None if rows is None else SFTRows(data_cursor=rows.data_cursor, n_rows=rows.n_rows),
        selection=selection,
    )


def checkpoint_request(inp: CheckpointInput) -> CheckpointRequest:
    return CheckpointRequest(step=inp.step, data_cursor=inp.data_cursor)


# rollout fields the workflow acts on (dynamic sampling rounds), not the rollout activity
ROLLOUT_WORKFLOW_ONLY = {"oversample", "dynamic_filter", "mode", "max_staleness"}  # the workflow schedules these; engines never see them


def rollout_request(inp: RolloutInput, n_rows: int) -> RolloutRequest:
    spec = inp.rollout.model_dump(exclude=ROLLOUT_WORKFLOW_ONLY | {"agent"})
    agent = inp.rollout.agent
    spec["agent"] = None if agent is None else AgentSettings.model_validate(agent.model_dump())
    if inp.n_prompts is not None:
        spec["prompts_per_step"] = inp.n_prompts
    return RolloutRequest(
        run_id=inp.run_id, step=inp.step, seed=inp.seed, policy_version=inp.policy_version,
        data_cursor=inp.data_cursor, n_rows=n_rows, round=inp.round, **spec,
    )


def eval_request(inp: EvalInput) -> EvalRequest:
    return EvalRequest(
        run_id=inp.run_id, step=inp.step, seed=inp.seed, policy_version=inp.policy_version, k=inp.k,
        temperature=inp.temperature, max_new_tokens=inp.max_new_tokens, chunk_size=inp.chunk_size,
        stop=list(inp.stop), stop_token_ids=list(inp.stop_token_ids),
    )


# ---- runtime -> workflow -------------------------------------------------------------
def run_events(events: list[NodeEvent]) -> list[RunEvent]:
    return [
        RunEvent(at=datetime.fromtimestamp(e.at, timezone.utc).isoformat(), kind=e.kind, detail=e.detail)
        for e in events
    ]


def rebuild_event(rebuild: Rebuild | None, policy_version: int) -> list[NodeEvent]:
    """A ``trainer_restored`` event when the trainer had to rebuild a version it lost
    (none for the first SFT warm-up of a run)."""
    if rebuild is None or (rebuild.restored_from_step is None and not rebuild.replayed_steps):
        return []
    source = (
        f"checkpoint step {rebuild.restored_from_step}" if rebuild.restored_from_step is not None
        else "no usable checkpoint: SFT warm-up"
    )
    replayed = f", replayed steps {rebuild.replayed_steps}" if rebuild.replayed_steps else ""
    return [NodeEvent(at=datetime.now(timezone.utc).timestamp(), kind="trainer_restored",
                      detail=f"{source}{replayed} -> v{policy_version}")]


def _trainer_state(rebuild: Rebuild | None, version: int, events: list[NodeEvent]) -> dict:
    """The fields every trainer result reports: how the trainer got to ``version`` and
    the events since the last report."""
    return {
        "restored_from_step": rebuild.restored_from_step if rebuild else None,
        "replayed_steps": rebuild.replayed_steps if rebuild else [],
        "node_events": run_events([*events, *rebuild_event(rebuild, version)]),
    }


def cell_info(cell: CellState | None, node: str) -> CellInfo | None:
    """The trainer's cell for the run's status (None: backend single)."""
    if cell is None:
        return None
    return CellInfo(node=node, generation=cell.generation, placement=cell.placement, ray_address=cell.ray_address,
                    ranks=[CellRankInfo(**r.model_dump()) for r in cell.ranks])


def dp_cells(dp: DPState | None, node: str) -> DPCells | None:
    """The trainer's DP cells for the run's status (None unless trainer.cells > 1)."""
    if dp is None:
        return None
    return DPCells(node=node, lighthouse_pid=dp.lighthouse_pid, lighthouse_restarts=dp.lighthouse_restarts,
                   cells=[DPCellStatus(**c.model_dump()) for c in dp.cells])


def cells_restarted(res: CellsRestarted, node_events: list[NodeEvent], node: str = "") -> RestartCellsResult:
    return RestartCellsResult(outcome=res.outcome, node_events=run_events([*node_events, *res.events]),
                              dp=dp_cells(res.dp, node))


def policy_info(info: VersionInfo, node_events: list[NodeEvent], node: str = "") -> PolicyInfo:
    return PolicyInfo(
        policy_version=info.policy_version, checksum=info.checksum, weights_key=info.weights_key,
        sft_metrics=info.sft_metrics, seconds=info.seconds, cell=cell_info(info.cell, node), dp=dp_cells(info.dp, node),
        **_trainer_state(info.rebuild, info.policy_version, [*node_events, *info.events]),
    )


def train_step_result(res: TrainResult, node_events: list[NodeEvent], node: str = "") -> TrainStepResult:
    return TrainStepResult(
        policy_version=res.policy_version, checksum=res.checksum, weights_key=res.weights_key,
        metrics=res.metrics, seconds=res.seconds, cell=cell_info(res.cell, node), dp=dp_cells(res.dp, node),
        **_trainer_state(res.rebuild, res.policy_version - 1, [*node_events, *res.events]),
    )


def checkpoint_result(saved: CheckpointSaved, seconds: float, node_events: list[NodeEvent]) -> CheckpointResult:
    return CheckpointResult(
        step=saved.step, key=saved.key, durable=saved.durable, seconds=seconds,
        node_events=run_events([*node_events, *saved.events, *rebuild_event(saved.rebuild, saved.step)]),
    )


def eval_result(inp: EvalInput, stats: EvalStats, node_events: list[NodeEvent]) -> EvalResult:
    return EvalResult(
        step=inp.step, policy_version=inp.policy_version, greedy_accuracy=stats.greedy_accuracy,
        pass_at_k=stats.pass_at_k, k=stats.k, n=stats.n, seconds=stats.seconds, node_events=run_events(node_events),
    )


def engine_slot(s: SlotInfo) -> EngineSlotInfo:
    version = int(s.weight_version) if s.weight_version is not None and s.weight_version.isdigit() else None
    return EngineSlotInfo(**s.model_dump(exclude={"weight_version"}), weight_version=version)
