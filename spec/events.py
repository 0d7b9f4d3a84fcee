"""What happened to a run, one model per kind of event: an engine died, a trainer was restored,
a DP cell healed, a node was lost, ...

``RunEvent`` is the union of them, told apart by ``kind``: a process builds the model of what
it saw, with what it knows as fields; the activity results, the workflow's state and
``milestone status`` carry the model, and a test reads its fields. Only
``spec.event_text.event_text`` turns one into a sentence (``milestone status``, the run's
details in the Temporal UI, logs).

Every event has ``at``, its ISO 8601 time in UTC: a process gives ``utc_now()``, a workflow its
own ``workflow.now()``, so a replay builds the same event.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field


def utc_now() -> str:
    """Now, as an event's ``at``: a process's clock (a workflow gives ``workflow.now().isoformat()``)."""
    return datetime.fromtimestamp(time.time(), UTC).isoformat()


class Event(BaseModel):
    """What every event has: when it happened."""

    at: str  # ISO 8601 time in UTC


# ---- engines (the node's fleet; ``slot`` is the engine's slot) ------------------------------
class EngineDead(Event):
    kind: Literal["engine_dead"] = "engine_dead"
    slot: int
    pid: int | None  # the engine's process when it was declared dead
    reason: str  # process exited, health probe failed, weight update failed, ...


class EngineHung(Event):
    """A health probe timed out (an ``engine_dead`` follows)."""

    kind: Literal["engine_hung"] = "engine_hung"
    slot: int
    reason: str


class EngineRestarted(Event):
    kind: Literal["engine_restarted"] = "engine_restarted"
    slot: int
    pid: int | None
    model_path: str


class EngineRecovered(Event):
    kind: Literal["engine_recovered"] = "engine_recovered"
    slot: int
    version: str | None  # the weights it serves


class EngineChecksum(Event):
    """An engine's weights checked against the version it should serve."""

    kind: Literal["checksum_ok", "checksum_mismatch"]
    slot: int
    version: str | None = None  # the version the engine reports (None: checked after a restart)
    checksum: str | None = None  # the engine's (``probed``: the folder's, which the engine stands for)
    expected: str | None = None  # the checksum wanted, where it differed
    probed: bool = False  # no full hash (SGLang): sampled parameters compared with the folder's
    mismatched: list[str] = []  # the sampled parameters that differ


class WeightSyncFallback(Event):
    """``weight_sync: distributed`` did not reach the engine: it loads the version from disk."""

    kind: Literal["weight_sync_fallback"] = "weight_sync_fallback"
    slot: int
    version: str
    error: str | None  # the engine's side of the failed push
    trainer_error: str = ""  # the trainer's side


class WeightsReceived(Event):
    """``weight_sync: distributed`` across hosts: a rollout node's engines got the version from the
    trainer's weight-update group (no pull, no disk)."""

    kind: Literal["weights_received"] = "weights_received"
    version: str
    slots: list[int]  # the engines that received it
    group: str  # the push's group
    nbytes: int  # bytes each engine received
    seconds: float  # registration, join and receive, on this node


class EngineAdded(Event):
    kind: Literal["engine_added"] = "engine_added"
    slot: int
    num_engines: int
    port: int


class EngineRemoved(Event):
    kind: Literal["engine_removed"] = "engine_removed"
    slot: int
    num_engines: int


# ---- the trainer and its store -----------------------------------------------------------
class TrainerRestarted(Event):
    kind: Literal["trainer_restarted"] = "trainer_restarted"
    old_pid: int
    returncode: int | None
    pid: int | None


class TrainerRestored(Event):
    """The trainer rebuilt a version it had lost: from a checkpoint (or the SFT warm-up), then replayed steps."""

    kind: Literal["trainer_restored"] = "trainer_restored"
    restored_from_step: int | None  # None: no usable checkpoint, the SFT warm-up
    replayed_steps: list[int]
    version: int  # the version it holds now


class CheckpointUploadFailed(Event):
    kind: Literal["checkpoint_upload_failed"] = "checkpoint_upload_failed"
    step: int
    error: str


class CheckpointCorrupt(Event):
    kind: Literal["checkpoint_corrupt"] = "checkpoint_corrupt"
    step: int
    file: str
    stored_in: str  # the checkpoint folder whose upload holds the file
    expected: str  # sha256
    actual: str  # sha256, or "missing"


class DiskFull(Event):
    """A write failed for lack of space: the node agent's (the run waits) or the checkpoint store's (retried)."""

    kind: Literal["disk_full"] = "disk_full"
    what: str
    error: str
    node: str = ""  # the node agent's event
    step: int | None = None  # the checkpoint store's
    free_bytes: int | None = None


class StaleWriteRefused(Event):
    """A write from a placement the run has left behind, refused by the run's fence."""

    kind: Literal["stale_write_refused"] = "stale_write_refused"
    node: str
    epoch: int
    error: str


# ---- a fsdp2 cell ------------------------------------------------------------------------
class CellStarted(Event):
    kind: Literal["cell_started"] = "cell_started"
    generation: int
    ranks: int
    placement: str
    pids: list[int]
    ray_address: str  # "local": a Ray instance the trainer process started


CellFailureKind = Literal["cell_failed", "cell_rank_died", "cell_rank_hung", "cell_placement_failed", "ray_unavailable"]


class CellFailed(Event):
    """A call on the cell failed (kind: ``gpu_runtime.trainer.fsdp2.errors``); the next call rebuilds it."""

    kind: CellFailureKind
    generation: int
    error_type: str
    message: str  # the error's first line


# ---- DP cells ----------------------------------------------------------------------------
class CellsStarted(Event):
    kind: Literal["cells_started"] = "cells_started"
    pids: list[int | None]
    lighthouse_pid: int | None


class CellLost(Event):
    kind: Literal["cell_lost"] = "cell_lost"
    cell: int
    pid: int | None
    why: str


class CellRestartFailed(Event):
    kind: Literal["cell_restart_failed"] = "cell_restart_failed"
    cell: int
    error: str


class CellRestarted(Event):
    """A lost cell runs again; it heals from a peer at the next step."""

    kind: Literal["cell_restarted"] = "cell_restarted"
    cell: int
    old_pid: int | None
    pid: int | None


class CellHealed(Event):
    """A restarted cell copied a peer's state, then trained the step with it."""

    kind: Literal["cell_healed"] = "cell_healed"
    cell: int
    held_version: int  # its state before
    copied_version: int
    trained_version: int


class CellVersion(BaseModel):
    cell: int
    version: int
    state_checksum: str


class CellsDiverged(Event):
    """The DP cells hold different state after the same call (the group is dead)."""

    kind: Literal["cells_diverged"] = "cells_diverged"
    cells: list[CellVersion]
    expected_version: int | None = None


class LighthouseRestarted(Event):
    kind: Literal["lighthouse_restarted"] = "lighthouse_restarted"
    pid: int | None


class LighthouseRestartFailed(Event):
    kind: Literal["lighthouse_restart_failed"] = "lighthouse_restart_failed"
    error: str


# ---- the run (said by the workflow and the CLI) ------------------------------------------
class NodeClaimed(Event):
    kind: Literal["node_claimed"] = "node_claimed"
    queue: str
    role: Literal["trainer", "rollout"] = "trainer"  # rollout: one of the run's rollout nodes (engines.nodes)


class NodeLost(Event):
    kind: Literal["node_lost"] = "node_lost"
    queue: str
    message: str
    step: int | None = None  # the step it was lost during (None: while being placed)
    role: Literal["trainer", "rollout"] = "trainer"


class Divergence(Event):
    """The step's loss was not finite: the run pauses on its last good state."""

    kind: Literal["divergence"] = "divergence"
    step: int
    message: str


class EvalFailed(Event):
    kind: Literal["eval_failed"] = "eval_failed"
    step: int
    message: str


class EvalSkipped(Event):
    kind: Literal["eval_skipped"] = "eval_skipped"
    why: str  # why the run has no held-out split


class DynamicFilterEmpty(Event):
    """No group's rewards varied in any round: the step trained on the first round's groups."""

    kind: Literal["dynamic_filter_empty"] = "dynamic_filter_empty"
    step: int
    rounds: int
    groups_trained: int


class HParamsSet(Event):
    kind: Literal["hparams_set"] = "hparams_set"
    values: dict[str, Any]  # the fields ``milestone set`` gave


class EnginesSet(Event):
    kind: Literal["engines_set"] = "engines_set"
    before: int
    after: int  # from the next step
    setting: Literal["num_engines", "nodes"] = "num_engines"


class Forked(Event):
    kind: Literal["forked"] = "forked"
    parent: str  # the run forked from
    step: int


RunEvent = Annotated[
    EngineDead | EngineHung | EngineRestarted | EngineRecovered | EngineChecksum | WeightSyncFallback | WeightsReceived
    | EngineAdded | EngineRemoved | TrainerRestarted | TrainerRestored | CheckpointUploadFailed | CheckpointCorrupt | DiskFull
    | StaleWriteRefused | CellStarted | CellFailed | CellsStarted | CellLost | CellRestartFailed | CellRestarted
    | CellHealed | CellsDiverged | LighthouseRestarted | LighthouseRestartFailed | NodeClaimed | NodeLost | Divergence
    | EvalFailed | EvalSkipped | DynamicFilterEmpty | HParamsSet | EnginesSet | Forked,
    Field(discriminator="kind"),
]
EngineEvent = (
    EngineDead | EngineHung | EngineRestarted | EngineRecovered | EngineChecksum | WeightSyncFallback | WeightsReceived
    | EngineAdded | EngineRemoved
)
