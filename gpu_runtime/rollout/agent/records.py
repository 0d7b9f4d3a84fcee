"""What an agent episode leaves in the run's store, turn by turn, and where.

Under ``<step>/rollout/[round-RR/]episodes/chunk-CCCC/`` (``episodes_prefix``):

* ``turn-TT.model.json`` — the model turn ``TT`` of the chunk's active episodes, generated
  as one batch (``ModelTurnBatch``), written before any tool of that turn runs;
* ``ep-EEEE/turn-TT.json`` — episode ``EEEE``'s finished turn ``TT`` (``TurnRecord``: the
  model's tokens and the tool turn's result and tokens), written before the result is used;
* ``ep-EEEE/calls/turn-TT-<uuid>.json`` — one per tool execution, written just before the
  tool runs (tool, arguments, time, pid): the execution log. The finished turn names the
  entry whose result it holds (``TurnRecord.execution``); any other entry for the turn is an
  execution a crash cut off before its result was recorded, never one after it.

``EEEE`` is the sample's position in its chunk. Every key is a pure function of
(run, step, round, chunk, episode, turn), so a retried rollout finds what an earlier
attempt finished and resumes each episode after its last finished turn.
"""

from __future__ import annotations

from pydantic import BaseModel

from gpu_runtime.store import artifacts as art

OUTCOMES = ("completed", "truncated", "tool_error", "timeout")  # how an episode ends (TurnRecord.outcome)


def episodes_prefix(run_id: str, step: int, chunk: int, round_: int = 0) -> str:
    chunk_key = art.rollout_chunk_key(run_id, step, chunk, round_)
    return chunk_key.rsplit("/", 1)[0] + f"/episodes/chunk-{chunk:04d}"


def model_turn_key(prefix: str, turn: int) -> str:
    return f"{prefix}/turn-{turn:02d}.model.json"


def turn_key(prefix: str, episode: int, turn: int) -> str:
    return f"{prefix}/ep-{episode:04d}/turn-{turn:02d}.json"


def calls_prefix(prefix: str, episode: int) -> str:
    return f"{prefix}/ep-{episode:04d}/calls"


class ModelOutput(BaseModel):
    ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


class ModelTurnBatch(BaseModel):
    """One model turn of a chunk's active episodes, in episode order."""

    turn: int
    episodes: list[int]
    outputs: list[ModelOutput]
    engine_url: str = ""
    seconds: float


class TurnRecord(BaseModel):
    turn: int
    model_ids: list[int]
    model_logprobs: list[float]
    finish_reason: str
    model_text: str
    tool: str = ""  # the tool called ("" : none)
    arguments: str = ""
    executed: bool = False  # the tool ran (a malformed call or a call on the last turn does not)
    execution: str = ""  # the execution log entry whose result this is
    observation: str | None = None  # what the model was shown next (None: no tool turn)
    error: str = ""  # the tool call failed
    reward: float | None = None  # a per-turn reward from a custom environment
    env_ids: list[int] = []  # the tool turn's templated tokens (loss mask 0)
    seconds: float  # this turn's model batch time plus its tool time
    outcome: str | None = None  # set on the turn that ended the episode
