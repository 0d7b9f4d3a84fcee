"""Tools and environments registered by dotted path in the agent tests (docs/agents.md)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gpu_runtime.rollout.agent.tool_api import ToolCall, ToolResult


@dataclass
class Upper:
    """A custom tool: the argument in upper case (returns a plain string)."""

    name: str = "upper"

    def __call__(self, arguments: str) -> str:
        return arguments.upper()


def make_upper() -> Upper:
    return Upper()


@dataclass
class Sleeper:
    name: str = "sleep"

    def __call__(self, arguments: str) -> str:
        time.sleep(float(arguments))
        return "woke"


def not_a_tool() -> object:
    return object()


@dataclass
class EveryTurnCalls:
    """An environment that treats every model turn as a call (so episodes with a random-init
    model run all their turns), answers with the call's length and a per-turn reward, and
    counts its executions in ``executed``. Its answers depend on the call only: a resumed
    episode gets a fresh environment (docs/agents.md)."""

    row: dict
    executed: list[str] = field(default_factory=list)

    def parse(self, model_text: str) -> ToolCall | None:
        return ToolCall("count", model_text[:8])

    def execute(self, call: ToolCall) -> ToolResult:
        self.executed.append(self.row["id"])
        return ToolResult(output=f"len {len(call.arguments)}", reward=0.5)


ENVIRONMENTS: list[EveryTurnCalls] = []


def every_turn_calls(row: dict) -> EveryTurnCalls:
    env = EveryTurnCalls(row)
    ENVIRONMENTS.append(env)
    return env
