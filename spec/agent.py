"""The ``rollout.agent`` section: multi-turn, tool-calling episodes (docs/agents.md).

Absent (the default), a rollout samples one response per prompt. Present, each sample
is an episode, written one of three ways (``kind``):

* ``tools``: our loop calls the configured tools; the model's calls are read by a
  tool-call parser (``tool_parser``: the model's native format or our tags);
* ``environment``: our loop, your ``parse``/``execute`` environment;
* ``openai``: your own agent code (``entrypoint``), run in a child process, calling an
  OpenAI-compatible endpoint that the node serves for the episode.

Torch-free; part of the workflow input.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from spec.strict import Strict

BUILTIN_TOOLS = ("calculator", "python")
KINDS = ("tools", "environment", "openai")
# how a model's turn writes its tool calls (gpu_runtime.rollout.agent.tool_parsers); auto: from the chat template
TOOL_PARSERS = ("auto", "tags", "hermes", "llama3_json", "mistral")
ON_AGENT_ERROR = ("zero", "score")
_DOTTED = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*([:.][A-Za-z_][\w]*)")


class AgentSpec(Strict):
    kind: str = Field(
        "tools",
        description="tools: our loop with the configured tools; environment: our loop with agent.environment "
        "(the default when environment is set); openai: your code (agent.entrypoint) against an OpenAI-compatible "
        "endpoint",
    )
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
    tool_parser: str = Field(
        "auto",
        description="how the model writes tool calls: hermes (<tool_call>{json}</tool_call>, Qwen2.5), llama3_json, "
        "mistral ([TOOL_CALLS]), tags (<NAME>ARGS</NAME>), or auto (detected from the chat template)",
    )
    entrypoint: str | None = Field(
        None, description="kind openai: pkg.module:run, called as run(base_url, api_key, row) in a child process"
    )
    max_calls: int = Field(16, ge=1, le=1024, description="kind openai: chat-completion calls per episode at most")
    on_agent_error: str = Field(
        "zero",
        description="kind openai: an agent that raises, hangs past episode_timeout_s or never calls the endpoint: "
        "zero (reward 0) or score (the reward function scores what it wrote)",
    )
    agent_restarts: int = Field(
        2, ge=0, le=16,
        description="kind openai: times an agent process killed from outside (a signal) is restarted in place, "
        "its recorded calls replayed",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_kind(cls, data: object) -> object:
        """``environment`` set without a ``kind`` means ``kind: environment`` (configs written before kinds)."""
        if isinstance(data, dict) and "kind" not in data and data.get("environment") is not None:
            return {**data, "kind": "environment"}
        return data

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {v!r}")
        return v

    @field_validator("tool_parser")
    @classmethod
    def _tool_parser(cls, v: str) -> str:
        if v not in TOOL_PARSERS:
            raise ValueError(f"tool_parser must be one of {', '.join(TOOL_PARSERS)}, got {v!r}")
        return v

    @field_validator("on_agent_error")
    @classmethod
    def _on_agent_error(cls, v: str) -> str:
        if v not in ON_AGENT_ERROR:
            raise ValueError(f"on_agent_error must be zero or score, got {v!r}")
        return v

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint(cls, v: str | None) -> str | None:
        if v is not None and not _DOTTED.fullmatch(v):
            raise ValueError(f"entrypoint {v!r} must be a dotted path pkg.module:run")
        return v

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
        if self.kind == "openai":
            if self.entrypoint is None:
                raise ValueError("kind openai needs entrypoint: pkg.module:run, your agent's run(base_url, api_key, row)")
        elif self.entrypoint is not None:
            raise ValueError(f"entrypoint is for kind openai (kind is {self.kind})")
        if self.kind == "environment" and self.environment is None:
            raise ValueError("kind environment needs environment: pkg.module:factory")
        if self.kind == "tools" and not self.tools:
            raise ValueError("give at least one tool, or an environment")
        if self.max_tokens_per_turn > self.max_episode_tokens:
            raise ValueError(
                f"max_tokens_per_turn {self.max_tokens_per_turn} exceeds max_episode_tokens {self.max_episode_tokens}"
            )
        return self
