"""The ``rollout.agent`` section as the node agent receives it. It mirrors
``workflows.agent_config.AgentSpec`` field for field (tests/unit/test_translate.py), so
it has no defaults of its own: they live in the run config only."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

OUTCOMES = ("completed", "truncated", "tool_error", "timeout")


class AgentSettings(BaseModel):
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
