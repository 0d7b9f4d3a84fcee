"""The training half of a step: train_step, update_weights, checkpoint and the held-out eval."""

from __future__ import annotations

from pydantic import BaseModel

from spec.engine import EngineSpec
from spec.events import RunEvent
from spec.placement import Placed
from spec.status import EngineSlotInfo
from spec.trainer_rpc import StepBatch, TrainedStep
from workflows.contracts.sampling import SamplingStats
from workflows.contracts.weight_group import GroupSeat


class TrainStepInput(Placed):
    """Train ``batch`` (what the trainer stores before it trains, so a replay trains exactly it)."""

    batch: StepBatch
    sampling: SamplingStats | None = None  # dynamic sampling's counts, exported as metrics by the node


class TrainStepResult(TrainedStep):
    replayed_steps: list[int] = []
    restored_from_step: int | None = None
    node_events: list[RunEvent] = []


class UpdateWeightsInput(BaseModel):
    run_id: str
    store_uri: str
    policy_version: int  # the node finds its model folder: the trainer's export, or the store's copy
    checksum: str
    engines: EngineSpec
    # a rollout node: the trainer node's weight server, which it pulls the version from ("": the version is
    # this node's own trainer's export, or the store's copy)
    source_url: str = ""
    # engines.weight_sync distributed with rollout nodes: this node's seat in the push's group (its engines
    # receive the version from the trainer's; those it does not reach pull it from source_url). None: no group
    group: GroupSeat | None = None


class UpdateWeightsResult(BaseModel):
    policy_version: int
    restarted_slots: list[int] = []
    engines: list[EngineSlotInfo] = []
    seconds: float
    node_events: list[RunEvent] = []


class CheckpointInput(Placed):
    step: int  # = the policy version to save
    data_cursor: int
    # wait until it is durable (the run's last step: the run ends with its final checkpoint and
    # model folder in the store); any other checkpoint is written and uploaded in the background
    durable: bool = False


class CheckpointResult(BaseModel):
    step: int
    key: str
    weights_key: str  # the version's model folder in the store ("": the trainer had no export of it to store)
    seconds: float
    durable: bool
    node_events: list[RunEvent] = []


class EvalInput(Placed):
    step: int
    seed: int
    policy_version: int  # the version the engines serve (= step): a sample from another fails the eval
    eval_key: str
    k: int
    temperature: float
    max_new_tokens: int
    chunk_size: int
    stop: list[str] = []  # rollout.stop / stop_token_ids: answers end as the rollout's do
    stop_token_ids: list[int] = []


class EvalResult(BaseModel):
    step: int
    policy_version: int
    greedy_accuracy: float  # pass@1 of the greedy (temperature 0) answers
    pass_at_k: float  # unbiased pass@k estimate from k samples per prompt (= any of the k correct)
    sampled_accuracy: float | None = None  # pass@1 at the eval temperature (the k samples' mean); None: older runs
    k: int
    n: int  # held-out prompts
    seconds: float
    node_events: list[RunEvent] = []
