"""What a tool and an environment are, as an agent episode sees them: a tool returns a
``ToolResult`` (or a string); an environment parses a model turn into a ``ToolCall`` and
executes it. Your own tools and environments import these (docs/agents.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

MAX_OBSERVATION_CHARS = 2000


@dataclass(frozen=True)
class ToolResult:
    output: str  # what the model sees (on a failure: "error: <message>" when empty)
    error: str = ""  # non-empty: the call failed
    timed_out: bool = False  # the call outlived agent.tool_timeout_s: the episode ends as timeout
    reward: float | None = None  # a per-turn reward (an environment may give one)

    @classmethod
    def failed(cls, message: str, output: str = "", *, timed_out: bool = False) -> ToolResult:
        return cls(output=output, error=message or "failed", timed_out=timed_out)

    def observation(self) -> str:
        """The text fed back to the model."""
        if not self.error:
            return self.output[-MAX_OBSERVATION_CHARS:]
        text = f"{self.output}\nerror: {self.error}" if self.output else f"error: {self.error}"
        return text[-MAX_OBSERVATION_CHARS:]


@runtime_checkable
class Tool(Protocol):
    @property
    def name(self) -> str: ...  # read-only: a frozen dataclass's field or a plain attribute

    def __call__(self, arguments: str) -> ToolResult | str: ...


@dataclass(frozen=True)
class ToolCall:
    tool: str
    arguments: str
    error: str = ""  # a malformed call (e.g. unclosed tag): not executed


class Environment(Protocol):
    """What answers a model's turn. ``parse`` is pure: the call in the turn's text, or
    ``None`` when the turn calls nothing (the episode is complete). ``execute`` has the
    side effects; the episode records its result before using it and never executes the
    same turn twice once that record exists."""

    def parse(self, model_text: str) -> ToolCall | None: ...

    def execute(self, call: ToolCall) -> ToolResult: ...
