"""What an OpenAI-kind agent episode leaves in the run's store, call by call, and where.

Under the chunk's episodes folder (``records.episodes_prefix``), per episode ``EEEE`` (the
sample's position in its chunk):

* ``ep-EEEE/call-KKK.json`` — the episode's chat-completion call ``KKK`` (``CallRecord``): the
  request's digest, the prompt and completion token ids, their logprobs, and the response the
  agent got, written **before** the response is returned;
* ``ep-EEEE/gen/call-KKK-<uuid>.json`` — one per generation, written just before the engines are
  asked (the generation log: a recorded call is never generated again, which the tests check);
* ``ep-EEEE/agent-AA.json`` — attempt ``AA`` of the agent's process: its pid and start time;
* ``ep-EEEE/episode.json`` — the agent's end (``EpisodeEnd``): how it ended and what it
  returned. A retried rollout never runs an ended episode's agent again.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


def call_key(prefix: str, episode: int, call: int) -> str:
    return f"{prefix}/ep-{episode:04d}/call-{call:03d}.json"


def episode_prefix(prefix: str, episode: int) -> str:
    return f"{prefix}/ep-{episode:04d}/"


def call_index(key: str) -> int | None:
    """The call number of a ``call_key``; ``None`` for any other key."""
    name = key.rsplit("/", 1)[-1]
    return int(name[5:8]) if name.startswith("call-") and name.endswith(".json") and "/gen/" not in key else None


def generation_key(prefix: str, episode: int, call: int, uid: str) -> str:
    return f"{prefix}/ep-{episode:04d}/gen/call-{call:03d}-{uid}.json"


def attempt_key(prefix: str, episode: int, attempt: int) -> str:
    return f"{prefix}/ep-{episode:04d}/agent-{attempt:02d}.json"


def end_key(prefix: str, episode: int) -> str:
    return f"{prefix}/ep-{episode:04d}/episode.json"


class CallRecord(BaseModel):
    call: int  # position in the episode
    digest: str  # the request's (openai_protocol.ChatRequest.digest): a replay must match it
    extends: bool  # the prompt is the previous call's prompt + completion + the new messages' tokens
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # the engine's: stop | length
    tool_calls: int  # calls returned to the agent
    tool_errors: int  # calls the parser could not read (left in the content)
    engine_url: str
    seconds: float
    response: dict[str, Any]  # the chat.completion body returned (returned again, as is, on replay)


AGENT_ENDS = ("completed", "agent_error", "timeout", "no_calls")


class EpisodeEnd(BaseModel):
    status: str  # completed | agent_error (raised, or killed past agent.agent_restarts) | timeout | no_calls
    answer: str | None = None  # what run() returned, as text (a dict's "answer", a string as is)
    error: str = ""  # the agent's exception or how its process ended
    calls: int  # calls the episode made
    attempts: int  # agent processes started (1 + restarts)
    seconds: float
