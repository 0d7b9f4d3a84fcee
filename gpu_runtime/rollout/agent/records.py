"""What an agent episode leaves in the run's store, turn by turn, and where.

Under ``<step>/rollout/[round-RR/]episodes/chunk-CCCC/`` (``episodes_prefix``):

* ``turn-TT.model.json`` — the model turn ``TT`` of the chunk's active episodes, generated
  as one batch (``ModelTurnBatch``), written before any tool of that turn runs;
* ``ep-EEEE/turn-TT.json`` — episode ``EEEE``'s finished turn ``TT`` (``TurnRecord``: the
  model's tokens and the tool turn's result and tokens), written before the result is used;
* ``ep-EEEE/calls/turn-TT-II-<uuid>.json`` — one per tool execution (call ``II`` of the turn:
  a turn may make several), written just before the tool runs (tool, arguments, time, pid):
  the execution log;
* ``ep-EEEE/results/turn-TT-II.json`` — call ``II``'s result (``CallRecord``), written as soon as
  the tool returns, before the next call of the turn runs. It names the log entry whose result
  it holds (``CallRecord.execution``); any other entry for the call is an execution a crash cut
  off before its result was recorded, never one after it.

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


def call_log_key(prefix: str, episode: int, turn: int, index: int, execution: str) -> str:
    return f"{calls_prefix(prefix, episode)}/turn-{turn:02d}-{index:02d}-{execution}.json"


def call_result_key(prefix: str, episode: int, turn: int, index: int) -> str:
    return f"{prefix}/ep-{episode:04d}/results/turn-{turn:02d}-{index:02d}.json"


def call_id(turn: int, index: int) -> str:
    """The call's ``tool_call_id`` in the chat: a pure function of its place, so a resumed episode
    renders the same tokens (nine alphanumerics: Mistral's templates require that shape)."""
    return f"call{turn:02d}{index:03d}"


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


class CallRecord(BaseModel):
    """One tool call of a model turn and what answered it."""

    index: int  # its place in the turn
    tool: str  # the tool it names ("" : a call with no readable name)
    arguments: str  # what the tool receives (a malformed call: its text as written)
    call_id: str  # its tool_call_id in the chat (records.call_id)
    error: str = ""  # malformed, invalid or failed: the model reads it as the tool's answer
    executed: bool = False  # the tool ran (a malformed call, a call on the last turn, a call after a stop do not)
    execution: str = ""  # the execution log entry whose result this is
    observation: str | None = None  # what the model was shown (None: not answered)
    timed_out: bool = False
    reward: float | None = None  # a per-call reward from the tool or a custom environment
    seconds: float = 0.0  # the tool's time


class TurnRecord(BaseModel):
    turn: int
    model_ids: list[int]
    model_logprobs: list[float]
    finish_reason: str
    model_text: str
    calls: list[CallRecord] = []  # the turn's calls in the order written ([]: it called nothing)
    reward: float | None = None  # the sum of its calls' rewards (None: none gave one)
    env_ids: list[int] = []  # the tool turn's templated tokens (loss mask 0)
    seconds: float  # this turn's model batch time plus its tools' time
    outcome: str | None = None  # set on the turn that ended the episode

    @property
    def tool_calls(self) -> int:
        """Calls the tools executed."""
        return sum(c.executed for c in self.calls)

    @property
    def tool_errors(self) -> int:
        """Calls answered with an error (malformed ones included)."""
        return sum(bool(c.error) and c.observation is not None for c in self.calls)
