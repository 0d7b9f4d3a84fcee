"""Tools and environments registered by dotted path in the agent tests (docs/agents.md)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

from gpu_runtime.rollout.agent.tool_api import ToolCall, ToolResult
from gpu_runtime.rollout.agent.tool_schemas import default_parameters


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


class Crash(BaseException):
    """A node agent dying inside a tool call (not an error the tool answers with)."""


CALCULATIONS: list[str] = []  # every execution of CountedCalculator, in order, across attempts
CRASH_ON: list[int] = []  # CountedCalculator dies on the n-th execution (1-based) when n is listed


@dataclass(frozen=True)
class CountedCalculator:
    """``calculator`` that logs each execution in ``CALCULATIONS`` and can die mid-turn (``CRASH_ON``)."""

    name: str = "calculator"
    schema: ClassVar[dict] = default_parameters("expression")

    def __call__(self, arguments: str) -> str:
        CALCULATIONS.append(arguments)
        if len(CALCULATIONS) in CRASH_ON:
            raise Crash(f"killed in execution {len(CALCULATIONS)}")
        a, b = arguments.split("*")
        return str(int(a) * int(b))


def make_counted_calculator() -> CountedCalculator:
    return CountedCalculator()
