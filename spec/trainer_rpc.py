"""The trainer process's RPC: every message that crosses it, built on the run-config sections,
and its methods (``TRAINER_RPC``: name, argument, result), which the node agent's client
(``gpu_runtime.trainer.process``) calls and the trainer's server (``gpu_runtime.trainer.server``)
registers one handler for each.

A message carries the sections themselves (``RunSetup.hparams`` is the run's ``TrainSpec``,
``RunSetup.model`` its ``ModelSpec``, ...), so a knob is declared once, with its default and
validation, and arrives at the trainer as the run config wrote it. ``StepBatch`` is also
stored before a step trains (replay reads it back).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from spec.model import DistillSpec, ModelSpec
from spec.events import RunEvent
from spec.placement import Placed
from spec.rpc import MethodTable, RpcMethod
from spec.status import CellInfo, DPCells
from spec.train import SFTSpec, TrainSpec
from spec.trainer import TrainerSpec


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ForkPoint(BaseModel):
    """A forked run's ancestor: the steps up to ``step`` (after the previous ancestor's)
    are that run's, and their artifacts live, read-only, under ``runs/<run_id>/``
    (``gpu_runtime.store.lineage``). Part of the run's state in history, so lenient."""

    run_id: str
    step: int


class SFTRows(BaseModel):
    """The dataset rows an SFT-mode step trains on: positions ``data_cursor ..
    data_cursor + n_rows - 1`` of the run's prompt order (``prompts_for_step``).
    Part of the train_step input in history, so lenient."""

    data_cursor: int
    n_rows: int


class RunSetup(Placed, Message):
    """What a trainer needs to serve a run; sent with every call, so a restarted
    trainer can rebuild the run's state without a separate bind. The workflow builds it
    (``init_policy``'s input); the node agent fills in what only it knows (``node_id``,
    ``offload_optimizer``). ``epoch``: the placement epoch every store write of a call carries."""

    seed: int
    model: ModelSpec
    sft: SFTSpec
    hparams: TrainSpec  # the run's initial ``train`` (the optimizer is built from it)
    dataset_key: str
    keep_last: int
    config_hash: str
    distill: DistillSpec | None
    lineage: list[ForkPoint] = []  # a fork: its ancestors, oldest first (gpu_runtime.store.lineage)
    node_id: str = ""  # the node the trainer runs on (named in refused writes): set by the node agent
    keep_versions: list[int] = []  # checkpoint.keep_versions: their model folders stay in the store
    trainer: TrainerSpec | None = None  # None: backend single
    # engines.release_memory resolved on: the optimizer state waits on the host between steps
    # (``gpu_runtime.trainer.common.offload``); set by the node agent, which knows the placement
    offload_optimizer: bool = False


class SampledRound(BaseModel):
    """One dynamic-sampling round of a step, as stored: its chunks and their rewards."""

    chunk_keys: list[str]
    rewards_key: str


class BatchSelection(BaseModel):
    """The trained batch of a step with dynamic sampling, as a selection: the rounds' chunks
    and rewards, and the (round, group index) of each trained group, in training order. The
    trainer reads each round's chunks once and takes these groups in memory; nothing is
    copied.
    Part of the train_step input in history, so lenient."""

    rounds: list[SampledRound]
    groups: list[tuple[int, int]]


class StepBatch(Message):
    """One step's training input, stored before training so replay uses exactly it:
    the rollout's chunks and rewards (RL), the kept groups of its rounds (``selection``,
    dynamic sampling; ``chunk_keys`` then empty), or the rows of an SFT-mode step (``sft``)."""

    step: int
    policy_version: int  # the version the trainer holds before the step
    chunk_keys: list[str]
    rewards_key: str
    group_size: int
    hparams: TrainSpec  # the step's ``train`` (set_hparams updates applied)
    sft: SFTRows | None = None  # None: an RL step
    selection: BatchSelection | None = None  # dynamic sampling: these groups of the rounds' chunks
    # rollout.temperature the chunks were sampled at: the trainer's logprobs, ratio, KL and entropy
    # are those of logits / temperature (a batch stored before it reads 1.0, as it trained)
    temperature: float = Field(1.0, gt=0)


class Rebuild(Message):
    """How a trainer that did not hold the version a call needed got there."""

    restored_from_step: int | None  # None: no usable checkpoint, rebuilt from the SFT warm-up
    replayed_steps: list[int]


class CellsRestarted(Message):
    """What ``restart_cells`` did to each DP cell asked for: restarting (its process starts in
    the background) | starting / alive (it was not lost) | no_group (no live cells: the next
    call builds them all) | failed: <why>."""

    outcome: dict[str, str]
    events: list[RunEvent] = []
    dp: DPCells | None = None


class VersionInfo(Message):
    """The trainer's current policy version, published as a model folder."""

    policy_version: int
    checksum: str
    model_path: str  # its model folder on the trainer's node (in the store only once checkpointed)
    sft_metrics: dict[str, float] = {}
    rebuild: Rebuild | None = None
    seconds: float = 0.0
    events: list[RunEvent] = []
    cell: CellInfo | None = None  # backend fsdp2: the cell that holds this version
    dp: DPCells | None = None  # trainer.cells > 1: the DP cells


class TrainedStep(BaseModel):
    """What a trained step reports: the trainer's reply (``TrainResult``) and, named with the
    node and the rebuild as events, the ``train_step`` activity's result (``TrainStepResult``)."""

    policy_version: int
    checksum: str
    metrics: dict[str, float]
    seconds: float
    cell: CellInfo | None = None  # backend fsdp2: the cell that trained the step
    dp: DPCells | None = None  # trainer.cells > 1: the DP cells after the step


class TrainResult(TrainedStep):
    model_config = ConfigDict(extra="forbid")

    rebuild: Rebuild | None = None
    events: list[RunEvent] = []


class CheckpointRequest(Message):
    step: int
    data_cursor: int
    sync: bool = False


class CheckpointSaved(Message):
    step: int
    key: str
    weights_key: str  # the version's model folder, stored beside the checkpoint (its only store copy; "": none exported here)
    durable: bool
    rebuild: Rebuild | None = None
    events: list[RunEvent] = []


# ---- RPC call arguments --------------------------------------------------------------
class EnsureVersionCall(Message):
    setup: RunSetup
    target: int


class TrainStepCall(Message):
    setup: RunSetup
    batch: StepBatch


class RestartCellsCall(Message):
    setup: RunSetup
    cells: list[int]


class CheckpointCall(Message):
    setup: RunSetup
    request: CheckpointRequest


class ForgetRunCall(Message):
    """A closed run: the trainer drops what it holds for it (the node then reclaims its files)."""

    run_id: str


class RunForgotten(Message):
    run_id: str
    held: bool  # the trainer was bound to the run (it is not any more)
    uploads_done: bool = True  # its background checkpoint uploads finished before it let go


# ---- weight broadcast (engines.weight_sync distributed) -------------------------------
class HeldWeightsCall(Message):
    run_id: str


class HeldWeights(Message):
    """The published version the trainer holds in memory (None: none of that run)."""

    policy_version: int | None = None
    checksum: str | None = None


class BroadcastWeightsCall(Message):
    """Join SGLang's weight-update group as rank 0 and broadcast the held version
    (``gpu_runtime.weight_sync.distributed``): the tensors in ``names`` order."""

    run_id: str
    policy_version: int
    checksum: str
    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: Literal["gloo", "nccl"]
    timeout_s: float
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    bucket_bytes: int = 0  # > 0: consecutive tensors packed per broadcast (torch engines; distributed.Manifest)
    # the rendezvous store at master_address:master_port is hosted by the node agent (a cross-host push,
    # ``group_rendezvous``): rank 0 connects to it as a client instead of serving it
    store_hosted: bool = False


class WeightsBroadcast(Message):
    policy_version: int
    nbytes: int
    join_seconds: float
    broadcast_seconds: float


# ---- the methods ---------------------------------------------------------------------
# the names are the wire's (``POST /call/<name>``)
ENSURE_VERSION = RpcMethod("ensure_version", EnsureVersionCall, VersionInfo)
TRAIN_STEP = RpcMethod("train_step", TrainStepCall, TrainResult)
CHECKPOINT = RpcMethod("checkpoint", CheckpointCall, CheckpointSaved)
RESTART_CELLS = RpcMethod("restart_cells", RestartCellsCall, CellsRestarted)
HELD_WEIGHTS = RpcMethod("held_weights", HeldWeightsCall, HeldWeights)
BROADCAST_WEIGHTS = RpcMethod("broadcast_weights", BroadcastWeightsCall, WeightsBroadcast)
FORGET_RUN = RpcMethod("forget_run", ForgetRunCall, RunForgotten)

TRAINER_RPC = MethodTable(
    "trainer RPC", ENSURE_VERSION, TRAIN_STEP, CHECKPOINT, RESTART_CELLS, HELD_WEIGHTS, BROADCAST_WEIGHTS, FORGET_RUN,
)
