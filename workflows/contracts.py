"""Payloads between workflows and activities: URIs, keys, versions, counts, scalars.

No tensor, token list or sample list ever travels here (DESIGN §2).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from workflows.trainer_config import TrainerSpec
from workflows.config import CheckpointSpec, DataSpec, DistillSpec, EngineSpec, EvalSpec, ModelSpec, RewardSpec, RolloutSpec, RunConfig, SFTSpec, TrainSpec

CONTROL_QUEUE = "milestone-control"
POOL_QUEUE = "milestone-gpu-pool"


class RunEvent(BaseModel):
    at: str
    kind: str  # engine_dead, engine_hung, engine_restarted, engine_recovered, checksum_ok, node_lost, ...
    detail: str = ""


class ForkPoint(BaseModel):
    """A forked run's ancestor: the steps up to ``step`` (after the previous ancestor's)
    are that run's, and their artifacts live, read-only, under ``runs/<run_id>/``."""

    run_id: str
    step: int


class NodeClaim(BaseModel):
    node_id: str
    boot_id: str
    task_queue: str
    epoch: int = 0  # this placement's epoch (gpu_runtime/store/fence.py); 0: a claim from before fencing


class ClaimNodeInput(BaseModel):
    run_id: str
    exclude_queues: list[str] = []
    store_uri: str = ""  # where the run's fence is (empty: no epoch)


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
    run_id: str
    store_uri: str
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
    epoch: int = 0  # the run's placement epoch: the store refuses writes of older ones (0: unfenced)
    trainer: TrainerSpec = TrainerSpec()  # single process, or a fsdp2 cell of ranks


class CellRankInfo(BaseModel):
    rank: int
    pid: int
    node_ip: str  # the Ray node the rank runs on
    node_id: str  # Ray's node id
    state: str  # alive | failed, as of the trainer's last result


class CellInfo(BaseModel):
    """A fsdp2 cell as the node's trainer last reported it (``milestone status`` lists it)."""

    node: str  # the node agent whose trainer process drives the cell
    generation: int  # cells that trainer process built; a rebuilt cell is the next
    placement: str  # strict_pack | spread
    ray_address: str  # "local": a Ray instance the trainer process started
    ranks: list[CellRankInfo]


class DPCellStatus(BaseModel):
    """One data-parallel cell (``trainer.cells``) as the node's trainer last reported it."""

    index: int
    pid: int
    state: str  # alive | lost | starting
    why: str = ""  # why it was lost
    restarts: int = 0
    policy_version: int = 0
    state_checksum: str = ""  # weights + AdamW + schedule + version (equal on every live cell)
    healed_from_step: int | None = None  # its state was last copied from a peer (it held this version)


class DPCells(BaseModel):
    """The run's DP cells and their torchft lighthouse."""

    node: str
    lighthouse_pid: int
    lighthouse_restarts: int = 0
    cells: list[DPCellStatus]


class CellHeal(BaseModel):
    """A lost DP cell the run will restart (``workflows.cell_heal``): when, and after how
    many failed restarts (the backoff is 5 s * 2^failures, capped)."""

    lost_at: str  # ISO time the run learnt of the loss
    due_at: float  # workflow time (unix seconds) from which the next restart may run
    failures: int = 0


class RestartCellsInput(BaseModel):
    run_id: str
    store_uri: str
    cells: list[int]
    epoch: int = 0


class RestartCellsResult(BaseModel):
    outcome: dict[str, str]  # cell index -> restarting | starting | alive | no_group | failed: <why>
    node_events: list[RunEvent] = []
    dp: DPCells | None = None


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


class RolloutInput(BaseModel):
    run_id: str
    step: int
    store_uri: str
    seed: int
    policy_version: int
    data_cursor: int  # the first prompt position this rollout draws
    dataset: DatasetInfo
    rollout: RolloutSpec
    round: int = 0  # dynamic sampling: the step's round (keys, seeds and sample ids of round > 0 differ)
    n_prompts: int | None = None  # prompts to draw (None: rollout.prompts_per_step)
    epoch: int = 0  # the run's placement epoch: the store refuses writes of older ones (0: unfenced)


class RolloutResult(BaseModel):
    chunk_keys: list[str]
    n_samples: int
    gen_tokens: int
    response_len_mean: float
    tokens_per_s: float
    chunks_reused: int = 0
    engine_retries: int = 0
    seconds: float
    node_events: list[RunEvent] = []
    agent: dict[str, float] | None = None  # rollout.agent: episode metrics (docs/agents.md); None: single-turn


class RewardInput(BaseModel):
    run_id: str
    step: int
    store_uri: str
    chunk_keys: list[str]
    dataset: DatasetInfo
    reward: RewardSpec
    round: int = 0  # dynamic sampling: the round whose chunks these are
    group_size: int = 0  # > 0: also report which groups' rewards vary (dynamic sampling)
    epoch: int = 0  # the run's placement epoch: the store refuses writes of older ones (0: unfenced)


class RewardResult(BaseModel):
    rewards_key: str
    reward_mean: float
    reward_std: float
    accuracy: float
    n: int
    seconds: float
    errors: int = 0  # samples scored 0 after a failed call (error_policy zero)
    # with group_size > 0: groups in order; the indices of those whose rewards vary, and the rest by kind
    groups: int = 0
    varied_groups: list[int] = []
    groups_all_correct: int = 0  # all rewards equal and every sample correct
    groups_all_wrong: int = 0  # all rewards equal and no sample correct
    groups_all_equal_other: int = 0  # all rewards equal, correctness mixed


class SamplingStats(BaseModel):
    """Dynamic sampling in one step: rounds drawn and what became of their groups."""

    rounds: int
    prompts_drawn: int  # = groups_generated; the data cursor advances by this
    groups_generated: int
    groups_kept: int  # groups whose rewards vary, over all rounds
    groups_filtered_all_correct: int
    groups_filtered_all_wrong: int
    groups_filtered_other: int  # all rewards equal, correctness mixed
    groups_trained: int  # kept groups trained on (at most prompts_per_step; see on_shortfall)
    trained_reward_mean: float  # mean reward of the trained batch (the step's reward_mean covers every round)
    fallback: bool = False  # no group was kept: the first round's groups were trained as they were


class Sampled(BaseModel):
    """A step's sampled batch (rollout and rewards, after any dynamic sampling): what the
    step trains on, and what its summary reports of the sampling. In ``one_step_off`` and
    ``fully_async`` an earlier step produces it (stamped with the version that generated it
    and the cursor it drew from), and ``TrainingRun`` carries it, in its buffer, to the step
    that trains on it."""

    chunk_keys: list[str]
    rewards_key: str
    prompts: int  # prompts drawn: the data cursor advances by this
    reward_mean: float  # over every generated sample (every round)
    reward_std: float
    accuracy: float
    reward_errors: int
    response_len_mean: float
    chunks_reused: int
    engine_retries: int
    phases: dict[str, float]
    node_events: list[RunEvent] = []
    sampling: SamplingStats | None = None
    policy_version: int = 0  # the weights the engines generated every sample of the batch with
    data_cursor: int = 0  # the cursor its prompts were drawn from
    agent: dict[str, float] | None = None  # rollout.agent: episode metrics (docs/agents.md)


class SampledRound(BaseModel):
    """One dynamic-sampling round of a step, as stored: its chunks and their rewards."""

    chunk_keys: list[str]
    rewards_key: str


class AssembleBatchInput(BaseModel):
    run_id: str
    step: int
    store_uri: str
    rounds: list[SampledRound]
    groups: list[tuple[int, int]]  # (round, group index) of each trained group, in training order
    group_size: int
    chunk_size: int
    sampling: SamplingStats  # the step's counts, exported as metrics by the control worker
    epoch: int = 0  # the run's placement epoch: the store refuses writes of older ones (0: unfenced)


class BatchResult(BaseModel):
    """The trained batch of a step with dynamic sampling (written by ``assemble_batch``)."""

    chunk_keys: list[str]
    rewards_key: str
    n_samples: int
    reward_mean: float
    accuracy: float
    seconds: float


class SFTRowsInput(BaseModel):
    """An SFT-mode step's rows: positions ``data_cursor .. data_cursor + n_rows - 1`` of the prompt order."""

    data_cursor: int
    n_rows: int


class TrainStepInput(BaseModel):
    run_id: str
    step: int
    store_uri: str
    policy_version: int  # version the trainer must hold before this step
    chunk_keys: list[str]
    rewards_key: str
    group_size: int
    train: TrainSpec
    sft_rows: SFTRowsInput | None = None  # mode sft: train on these rows' labels (no chunks, no rewards)
    epoch: int = 0  # the run's placement epoch: the store refuses writes of older ones (0: unfenced)


class TrainStepResult(BaseModel):
    policy_version: int
    checksum: str
    weights_key: str
    metrics: dict[str, float]
    replayed_steps: list[int] = []
    restored_from_step: int | None = None
    seconds: float
    node_events: list[RunEvent] = []
    cell: CellInfo | None = None  # backend fsdp2: the cell that trained the step
    dp: DPCells | None = None  # trainer.cells > 1: the DP cells after the step


class UpdateWeightsInput(BaseModel):
    run_id: str
    store_uri: str
    policy_version: int
    weights_key: str
    checksum: str
    engines: EngineSpec


class EngineSlotInfo(BaseModel):
    slot: int
    pid: int | None = None
    url: str = ""
    state: str
    weight_version: int | None = None
    checksum: str | None = None
    restart_count: int = 0


class UpdateWeightsResult(BaseModel):
    policy_version: int
    restarted_slots: list[int] = []
    engines: list[EngineSlotInfo] = []
    seconds: float
    node_events: list[RunEvent] = []


class NodeLivenessInput(BaseModel):
    run_id: str
    interval_s: float  # heartbeat this often until cancelled


class CheckpointInput(BaseModel):
    run_id: str
    step: int  # = the policy version to save
    store_uri: str
    data_cursor: int
    epoch: int = 0  # the run's placement epoch: the store refuses writes of older ones (0: unfenced)


class CheckpointResult(BaseModel):
    step: int
    key: str
    seconds: float
    durable: bool
    node_events: list[RunEvent] = []


class EvalInput(BaseModel):
    run_id: str
    step: int
    store_uri: str
    seed: int
    policy_version: int  # the version the engines serve (= step): a sample from another fails the eval
    eval_key: str
    k: int
    temperature: float
    max_new_tokens: int
    chunk_size: int
    epoch: int = 0  # the run's placement epoch: the store refuses writes of older ones (0: unfenced)
    stop: list[str] = []  # rollout.stop / stop_token_ids: answers end as the rollout's do
    stop_token_ids: list[int] = []


class EvalResult(BaseModel):
    step: int
    policy_version: int
    greedy_accuracy: float  # pass@1 of the greedy (temperature 0) answers
    pass_at_k: float  # unbiased pass@k estimate from k samples per prompt (= any of the k correct)
    k: int
    n: int  # held-out prompts
    seconds: float
    node_events: list[RunEvent] = []


class RLStepInput(BaseModel):
    run_id: str
    step: int
    config: RunConfig
    train: TrainSpec  # config.train with set_hparams updates applied
    policy_version: int
    data_cursor: int
    dataset: DatasetInfo
    node_queue: str
    epoch: int = 0  # the run's placement epoch: the store refuses writes of older ones (0: unfenced)
    # batches sampled during earlier steps, oldest first: this step trains the first (one_step_off,
    # fully_async; empty: the step samples its own). The step's own batch is for step ``step``, the
    # next for ``step + 1``, and so on.
    buffer: list[Sampled] = []
    prefetched: Sampled | None = None  # the one-batch buffer as recorded before ``buffer`` existed (read only)
    restart_cells: list[int] = []  # lost DP cells whose restart is due: restarted before this step trains


class StepSummary(BaseModel):
    step: int
    policy_version: int
    data_cursor: int  # cursor after this step
    reward_mean: float
    reward_std: float
    accuracy: float
    loss: float
    kl: float = 0.0
    grad_norm: float = 0.0
    response_len_mean: float = 0.0
    chunks_reused: int = 0  # rollout chunks found in the store (a retried rollout)
    engine_retries: int = 0  # engine deaths during the rollout attempt that succeeded (their chunks were resent)
    step_seconds: float
    phase_seconds: dict[str, float] = {}
    activity_seconds: float = 0.0  # sum of the activities' own times; the rest is orchestration
    checkpointed: bool = False
    weights_key: str = ""  # the new version as a Hugging Face model folder in the store
    restored_from_step: int | None = None  # the trainer was rebuilt from this checkpoint ...
    replayed_steps: list[int] = []  # ... and these steps were replayed from stored artifacts
    events: list[RunEvent] = []
    engines: list[EngineSlotInfo] = []
    cell: CellInfo | None = None  # backend fsdp2: the cell that trained the step (TrainingRun moves it to its state)
    eval_greedy: float | None = None  # held-out greedy accuracy after this step (None: not evaluated)
    eval_pass_at_k: float | None = None
    eval_k: int | None = None
    eval_n: int | None = None
    reward_errors: int = 0  # samples scored 0 after a failed reward call (error_policy zero)
    sampling: SamplingStats | None = None  # dynamic sampling (None: off)
    rollout_version: int | None = None  # the policy version that generated the trained samples
    overlap_seconds: float = 0.0  # sampling seconds of later steps' batches that ran during this train_step
    buffer_depth: int = 0  # batches sampled ahead when the step ended (one_step_off: 1, fully_async: up to K)
    next_buffer: list[Sampled] = []  # those batches, oldest first (TrainingRun moves them to its state)
    next_sampled: Sampled | None = None  # one_step_off's next batch as recorded before ``next_buffer`` (read only)

    @property
    def staleness(self) -> int:
        """Policy versions between the weights that sampled the batch and the ones it trained."""
        return 0 if self.rollout_version is None else self.policy_version - 1 - self.rollout_version
    agent: dict[str, float] | None = None  # rollout.agent: episode metrics of the step's rollout(s) (docs/agents.md)
    dp: DPCells | None = None  # trainer.cells > 1: the DP cells after the step (TrainingRun moves it to its state)
    cell_restarts: dict[str, str] = {}  # DP cells restarted before this step trained: index -> outcome
    dp_cells: int | None = None  # trainer.cells > 1: how many cells committed the step (fewer: a shrink step)


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
