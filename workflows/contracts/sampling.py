"""The sampling half of a step: rollout, rewards, dynamic sampling's rounds and trained batch (a
``BatchSelection``), and the sampled batch a step trains on (``Sampled``)."""

from __future__ import annotations

from pydantic import BaseModel

from spec.reward import RewardSpec
from spec.rollout import RolloutSpec
from spec.events import RunEvent
from spec.trainer_rpc import BatchSelection
from spec.placement import Placed
from workflows.contracts.placement import DatasetInfo


class RolloutInput(Placed):
    step: int
    seed: int
    policy_version: int
    data_cursor: int  # the first prompt position this rollout draws
    dataset: DatasetInfo
    rollout: RolloutSpec
    round: int = 0  # dynamic sampling: the step's round (keys, seeds and sample ids of round > 0 differ)
    n_prompts: int | None = None  # prompts to draw (None: rollout.prompts_per_step)
    # the chunks this node generates (None: all of them, held here for the rewards). A share of a rollout
    # spread over rollout nodes: its chunks are stored under this node's own keys and scored elsewhere
    chunks: list[int] | None = None


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


class RewardInput(Placed):
    step: int
    chunk_keys: list[str]
    dataset: DatasetInfo
    reward: RewardSpec
    round: int = 0  # dynamic sampling: the round whose chunks these are
    group_size: int = 0  # > 0: also report which groups' rewards vary (dynamic sampling)


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
    group_means: list[float] = []  # each group's mean reward, in order (what a trained selection reports)


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

    chunk_keys: list[str]  # the trained chunks and their rewards ([] and "" with a ``selection``)
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
    selection: BatchSelection | None = None  # dynamic sampling: the kept groups of the rounds' chunks
