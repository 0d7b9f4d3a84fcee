"""Where a run's artifacts live in the store, and what they contain.

Every key is a pure function of (run id, step, chunk, version), so a retried
activity finds the artifact a previous attempt wrote and returns it.
"""

from __future__ import annotations

import hashlib
import json

from typing import TypeVar

from pydantic import BaseModel

from gpu_runtime.store.object_store import ObjectStore


def _run(run_id: str) -> str:
    if not run_id or "/" in run_id or run_id.startswith("."):
        raise ValueError(f"invalid run id {run_id!r}: no '/' and not empty")
    return f"runs/{run_id}"


def run_prefix(run_id: str) -> str:
    """``runs/<run_id>``: everything a run writes lives under it (ValueError on a bad id)."""
    return _run(run_id)


def dataset_key(run_id: str, split: str) -> str:
    return f"{_run(run_id)}/data/{split}.jsonl"


def step_prefix(run_id: str, step: int) -> str:
    return f"{_run(run_id)}/steps/{step:06d}"


def _round(round_: int) -> str:
    """The folder of a dynamic-sampling round after the first (round 0 keeps the plain layout)."""
    return f"round-{round_:02d}/" if round_ else ""


def rollout_chunk_key(run_id: str, step: int, chunk: int, round_: int = 0, node: str = "") -> str:
    """``node``: a chunk generated as one node's share of a rollout spread over rollout nodes is
    stored under a key of that node's own, so a node the run has left behind (partitioned, then
    back) never writes a key the step trains."""
    own = f"-{node}" if node else ""
    return f"{step_prefix(run_id, step)}/rollout/{_round(round_)}chunk-{chunk:04d}{own}.json"


def eval_chunk_key(run_id: str, step: int, sampling: str, chunk: int) -> str:
    """A chunk of the held-out eval after ``step`` (``sampling``: greedy or sampled)."""
    return f"{step_prefix(run_id, step)}/eval/{sampling}-chunk-{chunk:04d}.json"


def rewards_key(run_id: str, step: int, round_: int = 0) -> str:
    return f"{step_prefix(run_id, step)}/{_round(round_)}rewards.json"


def judge_prefix(run_id: str, step: int, round_: int = 0) -> str:
    """Where a ``judge`` reward records each sample's result: ``<prefix>/<term>/<index>.json``."""
    return f"{step_prefix(run_id, step)}/{_round(round_)}judge"


def step_batch_key(run_id: str, step: int) -> str:
    """The step's training input (``StepBatch``), stored before training so replay reuses it."""
    return f"{step_prefix(run_id, step)}/step_batch.json"


def weights_prefix(run_id: str, version: int) -> str:
    return f"{_run(run_id)}/weights/v{version:06d}"


def base_model_prefix(run_id: str) -> str:
    """The run's base model folder (``model.init``), published once for LoRA adapter exports."""
    return f"{_run(run_id)}/base"


def checkpoints_prefix(run_id: str) -> str:
    return f"{_run(run_id)}/checkpoints"


M = TypeVar("M", bound=BaseModel)


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from (run seed, step, chunk, sample ...): stable across processes."""
    h = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def row_seed(batch_seed: int, row: int) -> int:
    """The seed of row ``row`` of a batch sampled with ``batch_seed``: what the torch engine
    seeds each row's generator with, and the ``sampling_seed`` sent per sample to SGLang."""
    return derive_seed(batch_seed, row)


class EpisodeInfo(BaseModel):
    """An agent episode's summary, carried by its ``Sample`` (built from its turn records,
    ``gpu_runtime.rollout.agent.records``, so a resumed episode carries the same one)."""

    outcome: str  # completed | truncated | tool_error | timeout; kind openai: completed | agent_error | timeout | no_calls
    turns: int  # model turns (kind openai: chat-completion calls)
    tool_calls: int  # tools executed (kind openai: tool calls returned to the agent)
    tool_errors: int  # failed calls (malformed ones included)
    max_calls_per_turn: int = 0  # the most calls one of its turns made
    turn_rewards: list[float | None] = []
    seconds: float = 0.0
    error: str = ""  # kind openai: how the agent failed
    zero_reward: bool = False  # kind openai: the agent failed and agent.on_agent_error is zero: rewarded 0, not scored
    segments: int = 1  # kind openai: runs of calls that extend one another (only the last is trained)


class Sample(BaseModel):
    sample_id: str  # "s<step>-p<prompt_index>-g<group_index>" ("s<step>-r<round>-p..." in round > 0)
    prompt_index: int  # index into the training dataset
    group_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # one per response token, under the generating weights
    weight_version: int
    finish_reason: str  # "stop" | "length" | "abort"
    # for rewards, never for training (token-in-token-out: training uses the ids above)
    prompt_text: str = ""
    response_text: str = ""  # response_ids decoded by the model's tokenizer, special tokens skipped
    # an agent episode: 1 per response token the model generated, 0 per tool-turn token (never trained);
    # its response_text is the model's last turn, what the reward scores (docs/agents.md)
    loss_mask: list[int] | None = None
    episode: EpisodeInfo | None = None


class RolloutChunk(BaseModel):
    run_id: str
    step: int
    chunk: int
    seed: int
    weight_version: int
    engine_url: str = ""
    node: str = ""  # the node id of the agent whose engine (engine_url) generated it
    samples: list[Sample]


class SampleReward(BaseModel):
    sample_id: str
    reward: float
    correct: bool
    detail: str = ""
    terms: dict[str, float] = {}  # a weighted reward: each term's (unweighted) value, by term name
    error: str = ""  # a call that failed and scored 0 (error_policy zero)


class StepRewards(BaseModel):
    run_id: str
    step: int
    rewards: list[SampleReward]  # same order as the concatenated chunks' samples


def put_model(store: ObjectStore, key: str, model: BaseModel) -> None:
    store.put_bytes(key, model.model_dump_json().encode())


def get_model(store: ObjectStore, key: str, cls: type[M]) -> M:
    return cls.model_validate_json(store.get_bytes(key))


def put_json(store: ObjectStore, key: str, obj: object) -> None:
    store.put_bytes(key, json.dumps(obj, sort_keys=True).encode())
