"""A step child workflow's input and its result (``RLStep``, ``SFTStep``)."""

from __future__ import annotations

from pydantic import BaseModel

from spec.run import RunConfig
from spec.events import RunEvent
from spec.status import CellInfo, DPCells, EngineSlotInfo
from spec.train import TrainSpec
from workflows.contracts.placement import DatasetInfo
from workflows.contracts.sampling import Sampled, SamplingStats


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
    restart_cells: list[int] = []  # lost DP cells whose restart is due: restarted before this step trains
    # engines.nodes > 0: the run's rollout nodes (their queues, in slot order), which generate, get each new
    # version from the trainer node's weight server (``weights_url``) and evaluate; empty: the trainer's node does
    rollout_queues: list[str] = []
    weights_url: str = ""


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
    # the train-inference logprob gap: mean and max |engine logprob - trainer old logprob| over
    # the trained response tokens (both of logits / rollout.temperature; 0: no engine logprobs)
    rollout_logprob_abs_diff: float = 0.0
    rollout_logprob_abs_diff_max: float = 0.0
    response_len_mean: float = 0.0
    chunks_reused: int = 0  # rollout chunks found in the store (a retried rollout)
    engine_retries: int = 0  # engine deaths during the rollout attempt that succeeded (their chunks were resent)
    step_seconds: float
    phase_seconds: dict[str, float] = {}
    activity_seconds: float = 0.0  # sum of the activities' own times; the rest is orchestration
    checkpointed: bool = False
    weights_key: str = ""  # a checkpointed step: the new version's Hugging Face model folder in the store ("": none)
    restored_from_step: int | None = None  # the trainer was rebuilt from this checkpoint ...
    replayed_steps: list[int] = []  # ... and these steps were replayed from stored artifacts
    events: list[RunEvent] = []
    engines: list[EngineSlotInfo] = []
    cell: CellInfo | None = None  # backend fsdp2: the cell that trained the step (TrainingRun moves it to its state)
    eval_greedy: float | None = None  # held-out greedy accuracy after this step (None: not evaluated)
    eval_pass_at_k: float | None = None
    eval_sampled: float | None = None  # held-out pass@1 at the eval temperature
    eval_k: int | None = None
    eval_n: int | None = None
    reward_errors: int = 0  # samples scored 0 after a failed reward call (error_policy zero)
    sampling: SamplingStats | None = None  # dynamic sampling (None: off)
    rollout_version: int | None = None  # the policy version that generated the trained samples
    overlap_seconds: float = 0.0  # sampling seconds of later steps' batches that ran during this train_step
    buffer_depth: int = 0  # batches sampled ahead when the step ended (one_step_off: 1, fully_async: up to K)
    next_buffer: list[Sampled] = []  # those batches, oldest first (TrainingRun moves them to its state)

    @property
    def staleness(self) -> int:
        """Policy versions between the weights that sampled the batch and the ones it trained."""
        return 0 if self.rollout_version is None else self.policy_version - 1 - self.rollout_version
    agent: dict[str, float] | None = None  # rollout.agent: episode metrics of the step's rollout(s) (docs/agents.md)
    dp: DPCells | None = None  # trainer.cells > 1: the DP cells after the step (TrainingRun moves it to its state)
    cell_restarts: dict[str, str] = {}  # DP cells restarted before this step trained: index -> outcome
    dp_cells: int | None = None  # trainer.cells > 1: how many cells committed the step (fewer: a shrink step)
    lost_rollout_queues: list[str] = []  # rollout nodes lost during the step (TrainingRun replaces them)
    checksum: str = ""  # the checksum of the version the step trained (a joining rollout node must serve it)
