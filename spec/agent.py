"""The ``rollout.agent`` section: multi-turn, tool-calling episodes (docs/agents.md).

Absent (the default), a rollout samples one response per prompt. Present, each sample
is an episode: a model turn, then a tool turn, until the model calls no tool or a
limit ends it. Torch-free; part of the workflow input.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from spec.strict import Strict

BUILTIN_TOOLS = ("calculator", "python")
_DOTTED = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*([:.][A-Za-z_][\w]*)")


class AgentSpec(Strict):
    tools: list[str] = Field(
        default_factory=lambda: ["calculator"],
        description="tools the model may call: calculator, python, or pkg.module:factory (a zero-argument "
        "callable returning a tool; docs/agents.md)",
    )
    environment: str | None = Field(
        None, description="pkg.module:factory(row) -> environment: replaces the tool environment (docs/agents.md)"
    )
    max_turns: int = Field(4, ge=1, le=64, description="model turns per episode at most (a call on the last is not run)")
    max_tokens_per_turn: int = Field(32, ge=1, description="tokens one model turn may generate")
    max_episode_tokens: int = Field(
        128, ge=1, description="tokens after the prompt (model and tool turns) an episode may hold"
    )
    tool_timeout_s: float = Field(
        10.0, gt=0, description="the tool turn's wall-clock limit (python: also its CPU seconds); past it: timeout"
    )
    episode_timeout_s: float = Field(
        300.0, gt=0, description="limit on the sum of the episode's recorded turn times; past it: timeout"
    )
    on_tool_error: str = Field(
        "continue",
        description="continue: the error is the tool's answer and the episode goes on; stop: the episode ends as tool_error",
    )
    tool_role: str = Field("tool", min_length=1, description="the chat role of a tool's answer in the chat template")

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"tools must be unique, got {v}")
        for t in v:
            if t not in BUILTIN_TOOLS and not _DOTTED.fullmatch(t):
                raise ValueError(
                    f"unknown tool {t!r}: use {' or '.join(BUILTIN_TOOLS)}, or a dotted path pkg.module:factory"
                )
        return v

    @field_validator("environment")
    @classmethod
    def _environment(cls, v: str | None) -> str | None:
        if v is not None and not _DOTTED.fullmatch(v):
            raise ValueError(f"environment {v!r} must be a dotted path pkg.module:factory")
        return v

    @field_validator("on_tool_error")
    @classmethod
    def _on_tool_error(cls, v: str) -> str:
        if v not in ("continue", "stop"):
            raise ValueError(f"on_tool_error must be continue or stop, got {v!r}")
        return v

    @model_validator(mode="after")
    def _budget(self) -> AgentSpec:
        if not self.tools and self.environment is None:
            raise ValueError("give at least one tool, or an environment")
        if self.max_tokens_per_turn > self.max_episode_tokens:
            raise ValueError(
                f"max_tokens_per_turn {self.max_tokens_per_turn} exceeds max_episode_tokens {self.max_episode_tokens}"
            )
        return self
