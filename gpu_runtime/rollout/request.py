"""What the node agent receives to run a step's rollout: ``RolloutRequest``, and its
``rollout.agent`` section (``AgentSettings``) when the step runs agent episodes."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict


class AgentSettings(BaseModel):
    """The ``rollout.agent`` section as the node agent receives it. It mirrors
    ``workflows.agent_config.AgentSpec`` field for field (tests/unit/test_translate.py), so
    it has no defaults of its own: they live in the run config only."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tools: list[str]
    environment: str | None
    max_turns: int
    max_tokens_per_turn: int
    max_episode_tokens: int
    tool_timeout_s: float
    episode_timeout_s: float
    on_tool_error: str
    tool_role: str


@dataclass(frozen=True)
class RolloutRequest:
    run_id: str
    step: int
    seed: int
    policy_version: int
    data_cursor: int
    n_rows: int
    prompts_per_step: int
    group_size: int
    chunk_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    round: int = 0  # dynamic sampling: the step's round (0: the first, or no filter)
    stop: list[str] = field(default_factory=list)  # SGLang's sampling params: stop strings
    stop_token_ids: list[int] = field(default_factory=list)  # and stop tokens besides EOS
    agent: AgentSettings | None = None  # multi-turn tool-calling episodes (gpu_runtime.rollout.agent)
