"""The tool calls of one model turn, as the episode loop reads and runs them.

Two sources of calls, one shape (``TurnCall``):

* ``ParsedCalls`` (``kind: tools``): the configured tools, the turn read by a tool-call parser
  (``tool_parsers``), each call's JSON arguments checked against its tool's schema
  (``tool_schemas``). A call that is malformed or invalid is answered with its error and never
  executed. A native parser's calls are rendered back as the template's ``tool_calls``, each
  answered by its own tool message; tags keep today's single tool message.
* ``EnvironmentCalls`` (``kind: environment``): your environment's ``parse``/``execute``, one call
  a turn at most, unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from gpu_runtime.rollout.agent.tool_api import Environment, Tool, ToolCall, ToolResult
from gpu_runtime.rollout.agent.tool_parsers import ToolParser
from gpu_runtime.rollout.agent.tool_schemas import arguments_text, schema_named, tool_schemas, validate_arguments
from gpu_runtime.rollout.agent.tools import run_tool


@dataclass(frozen=True)
class TurnCall:
    tool: str
    arguments: str  # what the tool receives (a malformed call: its text as written)
    parsed: dict | None = None  # the JSON arguments, for the template's tool_calls (None: none readable)
    error: str = ""  # not executed: answered with this error
    origin: ToolCall | None = None  # the environment's own call, handed back to its execute


class CallSource(Protocol):
    @property
    def native(self) -> bool: ...  # calls are rendered as the template's tool_calls, one tool message each

    def calls(self, text: str) -> list[TurnCall]: ...

    def execute(self, call: TurnCall) -> ToolResult: ...


class ParsedCalls:
    """The configured tools, called in the format ``parser`` reads."""

    def __init__(self, tools: Mapping[str, Tool], parser: ToolParser, timeout_s: float) -> None:
        self.tools = dict(tools)
        self.parser = parser
        self.timeout_s = timeout_s
        self.schemas = tool_schemas(self.tools.values())

    @property
    def native(self) -> bool:
        return self.parser.name != "tags"

    def calls(self, text: str) -> list[TurnCall]:
        out = []
        for c in self.parser.parse(text, self.schemas).calls:
            schema = schema_named(self.schemas, c.name)
            if c.error or c.arguments is None or schema is None:
                out.append(TurnCall(c.name, c.raw, c.arguments, c.error or f"unknown tool {c.name!r}"))
                continue
            invalid = validate_arguments(schema, c.arguments)
            text_args = c.raw if invalid else arguments_text(schema, c.arguments)
            out.append(TurnCall(c.name, text_args, c.arguments, invalid))
        return out

    def execute(self, call: TurnCall) -> ToolResult:
        return run_tool(self.tools[call.tool], call.arguments, self.timeout_s)


class EnvironmentCalls:
    """``agent.environment``: its ``parse`` finds at most one call, its ``execute`` answers it."""

    native = False

    def __init__(self, env: Environment) -> None:
        self.env = env

    def calls(self, text: str) -> list[TurnCall]:
        call = self.env.parse(text)
        return [] if call is None else [TurnCall(call.tool, call.arguments, None, call.error, origin=call)]

    def execute(self, call: TurnCall) -> ToolResult:
        return self.env.execute(call.origin or ToolCall(call.tool, call.arguments))
