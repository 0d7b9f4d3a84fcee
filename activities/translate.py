"""The real conversions between the workflow contracts and the node's runtime calls.

Both sides speak ``spec``: the run-config sections, the trainer's wire messages and the
status models are declared once there, so nothing here copies a field from one model
into its twin. What is left: an activity input becomes the runtime request it implies (a checkpoint's
``durable`` is the trainer's ``sync``, a dynamic-sampling round's ``n_prompts`` its
``prompts_per_step``), and a trainer result becomes the activity result the workflow records
(the rebuild as an event, the node named on its cells). ``init_policy`` and ``train_step``
carry the trainer's own ``RunSetup`` and ``StepBatch``: nothing to convert.
"""

from __future__ import annotations

from typing import TypeVar

from gpu_runtime.rollout.evaluate import EvalRequest, EvalStats
from gpu_runtime.rollout.request import RolloutRequest
from spec.events import RunEvent, TrainerRestored, utc_now
from spec.status import CellInfo, DPCells
from spec.trainer_rpc import (
    CellsRestarted, CheckpointRequest, CheckpointSaved, Rebuild, TrainResult, VersionInfo,
)
from workflows.contracts.cells import RestartCellsResult
from workflows.contracts.placement import PolicyInfo
from workflows.contracts.sampling import RolloutInput
from workflows.contracts.training import (
    CheckpointInput, CheckpointResult, EvalInput, EvalResult, TrainStepResult,
)


# ---- workflow -> runtime -------------------------------------------------------------
def checkpoint_request(inp: CheckpointInput) -> CheckpointRequest:
    return CheckpointRequest(step=inp.step, data_cursor=inp.data_cursor, sync=inp.durable)


def rollout_request(inp: RolloutInput, n_rows: int, node: str = "") -> RolloutRequest:
    """A dynamic-sampling round draws ``n_prompts`` prompts instead of ``rollout.prompts_per_step``;
    ``node``: the generating node's id (stamped on its chunks)."""
    rollout = inp.rollout if inp.n_prompts is None else inp.rollout.model_copy(update={"prompts_per_step": inp.n_prompts})
    return RolloutRequest(
        run_id=inp.run_id, step=inp.step, seed=inp.seed, policy_version=inp.policy_version,
        data_cursor=inp.data_cursor, n_rows=n_rows, rollout=rollout, round=inp.round, node=node,
        chunks=tuple(inp.chunks) if inp.chunks is not None else None,
    )


def eval_request(inp: EvalInput) -> EvalRequest:
    return EvalRequest(
        run_id=inp.run_id, step=inp.step, seed=inp.seed, policy_version=inp.policy_version, k=inp.k,
        temperature=inp.temperature, max_new_tokens=inp.max_new_tokens, chunk_size=inp.chunk_size,
        stop=list(inp.stop), stop_token_ids=list(inp.stop_token_ids),
    )


# ---- runtime -> workflow -------------------------------------------------------------
def rebuild_event(rebuild: Rebuild | None, policy_version: int) -> list[RunEvent]:
    """A ``trainer_restored`` event when the trainer had to rebuild a version it lost
    (none for the first SFT warm-up of a run)."""
    if rebuild is None or (rebuild.restored_from_step is None and not rebuild.replayed_steps):
        return []
    return [TrainerRestored(at=utc_now(), restored_from_step=rebuild.restored_from_step,
                            replayed_steps=rebuild.replayed_steps, version=policy_version)]


def _trainer_state(rebuild: Rebuild | None, version: int, events: list[RunEvent]) -> dict:
    """The fields every trainer result reports: how the trainer got to ``version`` and
    the events since the last report."""
    return {
        "restored_from_step": rebuild.restored_from_step if rebuild else None,
        "replayed_steps": rebuild.replayed_steps if rebuild else [],
        "node_events": [*events, *rebuild_event(rebuild, version)],
    }


Cells = TypeVar("Cells", CellInfo, DPCells)


def on_node(cells: Cells | None, node: str) -> Cells | None:
    """The trainer's cells (None: none of that kind) named with the node whose trainer runs them."""
    return None if cells is None else cells.model_copy(update={"node": node})


def cells_restarted(res: CellsRestarted, node_events: list[RunEvent], node: str = "") -> RestartCellsResult:
    return RestartCellsResult(outcome=res.outcome, node_events=[*node_events, *res.events], dp=on_node(res.dp, node))


def policy_info(info: VersionInfo, node_events: list[RunEvent], node: str = "") -> PolicyInfo:
    return PolicyInfo(
        policy_version=info.policy_version, checksum=info.checksum,
        sft_metrics=info.sft_metrics, seconds=info.seconds, cell=on_node(info.cell, node), dp=on_node(info.dp, node),
        **_trainer_state(info.rebuild, info.policy_version, [*node_events, *info.events]),
    )


def train_step_result(res: TrainResult, node_events: list[RunEvent], node: str = "") -> TrainStepResult:
    return TrainStepResult(
        policy_version=res.policy_version, checksum=res.checksum,
        metrics=res.metrics, seconds=res.seconds, cell=on_node(res.cell, node), dp=on_node(res.dp, node),
        **_trainer_state(res.rebuild, res.policy_version - 1, [*node_events, *res.events]),
    )


def checkpoint_result(saved: CheckpointSaved, seconds: float, node_events: list[RunEvent]) -> CheckpointResult:
    return CheckpointResult(
        step=saved.step, key=saved.key, weights_key=saved.weights_key, durable=saved.durable, seconds=seconds,
        node_events=[*node_events, *saved.events, *rebuild_event(saved.rebuild, saved.step)],
    )


def eval_result(inp: EvalInput, stats: EvalStats, node_events: list[RunEvent]) -> EvalResult:
    return EvalResult(
        step=inp.step, policy_version=inp.policy_version, greedy_accuracy=stats.greedy_accuracy,
        pass_at_k=stats.pass_at_k, sampled_accuracy=stats.sampled_accuracy, k=stats.k, n=stats.n, seconds=stats.seconds, node_events=node_events,
    )
