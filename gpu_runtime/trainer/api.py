"""The trainer process's typed API: every message that crosses its RPC.

Hyper-parameters have no defaults here: each value comes from the run config
(``workflows/config.py`` declares the knob, its default and its validation once)
through one translation function in ``activities/translate.py``, and a unit
test keeps the mirrored field sets equal.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict


def weights_folder(work_dir: Path, run_id: str, version: int) -> Path:
    """Where the trainer process (``--work-dir work_dir``) exports a version's model folder.
    The node agent links a version it pushes to its engines from there (same disk, no copy)."""
    return Path(work_dir) / run_id / "weights" / f"v{version:06d}"


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrainerHParams(Message):
    """The RL optimiser and loss settings of one step (``train`` in the run config)."""

    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    warmup_steps: int
    grad_clip: float
    estimator: Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "cispo", "ppo"]
    clip_eps: float
    clip_eps_high: float | None
    dual_clip_c: float | None
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
    loss_agg_norm_len: int | None
    kl_coef: float
    kl_estimator: Literal["k1", "k2", "k3"]
    kl_in_reward: bool
    entropy_coef: float
    tis_cap: float | None
    scale_adv_by_std: bool
    ppo_epochs: int
    micro_batch_size: int
    precision: Literal["fp32", "bf16"]
    gamma: float
    lam: float
    vf_coef: float
    value_clip: float | None
    critic_lr: float | None
    critic_warmup_steps: int


# Knobs added after runs were first stored, each with the value that reproduces the
# trainer from before it existed. Only for reading stored records (a step batch, a
# checkpoint's meta) written by an older version; live messages carry every field.
HPARAMS_ADDED_LATER: dict[str, object] = {
    "estimator": "grpo", "dual_clip_c": None, "loss_agg": "token_mean", "loss_agg_norm_len": None,
    "kl_estimator": "k3", "kl_in_reward": False, "entropy_coef": 0.0, "tis_cap": None,
    "gamma": 1.0, "lam": 0.95, "vf_coef": 1.0, "value_clip": 0.5, "critic_lr": None, "critic_warmup_steps": 0,
    "precision": "fp32",
}


def stored_hparams(raw: dict) -> TrainerHParams:
    """``TrainerHParams`` from a stored record, which may predate some knobs."""
    return TrainerHParams.model_validate({**HPARAMS_ADDED_LATER, **raw})


class SFTSettings(Message):
    """The supervised warm-up that produces policy version 0 (``sft`` in the run config)."""

    steps: int
    batch_size: int
    lr: float
    grad_clip: float | None
    betas: tuple[float, float]


class ModelInit(Message):
    """A new model to build as the v0 folder (``model.init`` in the run config)."""

    arch: Literal["qwen2", "llama"]
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    vocab_size: int
    tie_word_embeddings: bool


class LoraSettings(Message):
    """LoRA adapters on the base model (``model.lora`` in the run config)."""

    r: int
    alpha: float
    dropout: float
    target_modules: Literal["all-linear"] | list[str]
    export: Literal["merged", "adapter"]


class ModelSource(Message):
    """Where the run's base model comes from (``model`` in the run config)."""

    path: str | None
    init: ModelInit | None
    lora: LoraSettings | None


class DistillSettings(Message):
    """On-policy distillation from a teacher model folder (``distill`` in the run config)."""

    teacher_path: str
    coef: float


class Ancestor(Message):
    """A forked run's ancestor: steps up to ``step`` are read from ``run_id``'s prefix."""

    run_id: str
    step: int


class TrainerBackendSettings(Message):
    """How the trainer is placed (``trainer`` in the run config): one process, a fsdp2 cell, or
    one process training a megatron-core GPTModel."""

    backend: Literal["single", "fsdp2", "megatron"]
    ranks_per_cell: int
    placement: Literal["strict_pack", "spread"]
    ray_address: str | None
    collective_timeout_s: float
    cells: int  # independent data-parallel cells joined by torchft (gpu_runtime.trainer.dp)
    cell_restart_backoff_s: float  # the workflow's, mirrored (a lost cell's restart schedule)
    cell_restart_backoff_max_s: float


class RunSetup(Message):
    """What a trainer needs to serve a run; sent with every call, so a restarted
    trainer can rebuild the run's state without a separate bind."""

    run_id: str
    store_uri: str
    seed: int
    model: ModelSource
    sft: SFTSettings
    hparams: TrainerHParams  # the run's initial settings (the optimizer is built from them)
    dataset_key: str
    keep_last: int
    config_hash: str
    distill: DistillSettings | None
    lineage: list[Ancestor] = []  # a fork: its ancestors, oldest first (gpu_runtime.store.lineage)
    epoch: int = 0  # the placement epoch every store write of this call carries (0: unfenced)
    node_id: str = ""  # the node the trainer runs on (named in refused writes)
    trainer: TrainerBackendSettings | None = None  # None: backend single
    # engines.release_memory resolved on: the optimizer state waits on the host between steps
    # (``gpu_runtime.trainer.common.offload``); set by the node agent, which knows the placement
    offload_optimizer: bool = False


class SFTRows(Message):
    """The dataset rows an SFT-mode step trains on: positions ``data_cursor ..
    data_cursor + n_rows - 1`` of the run's prompt order (``prompts_for_step``)."""

    data_cursor: int
    n_rows: int


class SelectedRound(Message):
    """One dynamic-sampling round of a step: its chunks and their rewards."""

    chunk_keys: list[str]
    rewards_key: str


class BatchSelection(Message):
    """A step's batch as a selection (dynamic sampling): the (round, group index) of each
    trained group, in training order, taken from the rounds' samples."""

    rounds: list[SelectedRound]
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
    hparams: TrainerHParams
    sft: SFTRows | None
    selection: BatchSelection | None = None


def stored_step_batch(raw: str | bytes) -> "StepBatch":
    """A ``StepBatch`` stored before training, possibly by an older version (before SFT mode: RL;
    before selections: a dynamic-sampling step's ``batch/`` copy as its chunks and rewards)."""
    data = json.loads(raw)
    return StepBatch.model_validate({"sft": None, **data, "hparams": stored_hparams(data["hparams"])})


class NodeEvent(Message):
    """Something a node's processes did that the run should show (engine deaths,
    trainer restarts, corrupt checkpoints); drained into the next activity result."""

    at: float  # unix time
    kind: str
    detail: str = ""


class Rebuild(Message):
    """How a trainer that did not hold the version a call needed got there."""

    restored_from_step: int | None  # None: no usable checkpoint, rebuilt from the SFT warm-up
    replayed_steps: list[int]


class CellRankState(Message):
    """One rank of a fsdp2 cell, as the trainer process built it."""

    rank: int
    pid: int
    node_ip: str  # the Ray node the rank runs on
    node_id: str
    state: str  # alive | failed (a call on the cell failed; it is rebuilt by the next call)


class CellState(Message):
    """The trainer's live fsdp2 cell (``milestone status`` lists it)."""

    generation: int  # cells this trainer process built; a rebuilt cell is the next
    placement: str  # strict_pack | spread
    ray_address: str  # "local": a Ray instance the trainer process started
    ranks: list[CellRankState]


class DPCellInfo(Message):
    """One data-parallel cell (``trainer.cells``) as its group last saw it."""

    index: int
    pid: int
    state: str  # alive | lost | starting
    why: str = ""  # why it was lost
    restarts: int = 0
    policy_version: int = 0
    state_checksum: str = ""  # weights + AdamW + schedule + version, after its last call
    healed_from_step: int | None = None  # its state was last copied from a peer (it held this version)


class DPState(Message):
    """The trainer's DP cells and their torchft lighthouse (``milestone status`` lists them)."""

    lighthouse_pid: int
    lighthouse_restarts: int = 0
    cells: list[DPCellInfo]


class CellsRestarted(Message):
    """What ``restart_cells`` did to each DP cell asked for: restarting (its process starts in
    the background) | starting / alive (it was not lost) | no_group (no live cells: the next
    call builds them all) | failed: <why>."""

    outcome: dict[str, str]
    events: list[NodeEvent] = []
    dp: DPState | None = None


class VersionInfo(Message):
    """The trainer's current policy version, published as a model folder."""

    policy_version: int
    checksum: str
    weights_key: str
    model_path: str
    sft_metrics: dict[str, float] = {}
    rebuild: Rebuild | None = None
    seconds: float = 0.0
    events: list[NodeEvent] = []
    cell: CellState | None = None  # backend fsdp2: the cell that holds this version
    dp: DPState | None = None  # trainer.cells > 1: the DP cells


class TrainResult(Message):
    policy_version: int
    checksum: str
    weights_key: str
    metrics: dict[str, float]
    rebuild: Rebuild | None = None
    seconds: float
    events: list[NodeEvent] = []
    cell: CellState | None = None  # backend fsdp2: the cell that trained the step
    dp: DPState | None = None  # trainer.cells > 1: the DP cells after the step


class CheckpointRequest(Message):
    step: int
    data_cursor: int
    sync: bool = False


class CheckpointSaved(Message):
    step: int
    key: str
    durable: bool
    rebuild: Rebuild | None = None
    events: list[NodeEvent] = []


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


class WeightsBroadcast(Message):
    policy_version: int
    nbytes: int
    join_seconds: float
    broadcast_seconds: float
