"""Tools an agent episode can call, how a model's turn names one, and how your own is found.

A tool is any object with a ``name`` (the tag the model writes) and
``__call__(arguments: str) -> ToolResult | str`` (``tool_api``): a plain string is a success, a raised
exception a failed call (its message goes back to the model). Built in: ``calculator``
and ``python``. Your own: ``agent.tools: ["my_pkg.tools:make_weather"]`` names a
zero-argument callable (a class or function) returning such an object, imported on the
node agent (docs/agents.md).

How a model's turn writes its calls is the parser's business (``tool_parsers``: the model's
native format, or our tags ``<calculator>1234*5678</calculator>``); what a call's arguments
become for the tool, ``tool_schemas``'. ``parse_tool_call`` reads our tags for an environment
of your own that wants them.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import ClassVar

from gpu_runtime.rollout.agent import calculator
from gpu_runtime.rollout.agent.python_sandbox import PythonSandbox
from gpu_runtime.rollout.agent.tool_api import Environment, Tool, ToolCall, ToolResult
from gpu_runtime.rollout.agent.tool_parsers import first_tag
from gpu_runtime.rollout.agent.tool_schemas import default_parameters, tool_schema

GRACE_S = 5.0  # over agent.tool_timeout_s before a call is abandoned (python kills its child itself first)


class ToolNotFound(ValueError):
    """A configured tool cannot be imported or is not a tool."""


@dataclass(frozen=True)
class Calculator:
    """The ``calculator`` tool: arithmetic by ``ast`` (``gpu_runtime.rollout.agent.calculator``)."""

    name: str = "calculator"
    description: str = "evaluates an arithmetic expression (+ - * / // % ** and parentheses)"
    schema: ClassVar[dict] = default_parameters("expression")

    def __call__(self, arguments: str) -> ToolResult:
        try:
            return ToolResult(output=calculator.format_value(calculator.evaluate(arguments)))
        except calculator.CalculatorError as e:
            return ToolResult.failed(str(e))


def _python(timeout_s: float) -> Tool:
    return PythonSandbox(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s)))


BUILTIN: dict[str, Callable[[float], Tool]] = {"calculator": lambda _t: Calculator(), "python": _python}


def load_tool(spec: str, timeout_s: float) -> Tool:
    """A built-in tool by name, or ``pkg.module:factory`` / ``pkg.module.factory`` called with no
    arguments; ``ToolNotFound`` when it cannot be imported or what it returns is no tool."""
    if spec in BUILTIN:
        return BUILTIN[spec](timeout_s)
    mod_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError, ValueError, SyntaxError) as e:
        raise ToolNotFound(f"agent.tools: cannot import {spec!r}: {type(e).__name__}: {e}") from e
    tool = factory()
    name = getattr(tool, "name", None)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][\w-]*", name) or not callable(tool):
        raise ToolNotFound(f"agent.tools: {spec!r} returned {tool!r}: a tool needs a name (a tag) and __call__(arguments)")
    try:
        tool_schema(tool)
    except ValueError as e:
        raise ToolNotFound(f"agent.tools: {spec!r}: {e}") from e
    return tool


def load_tools(specs: Sequence[str], timeout_s: float) -> dict[str, Tool]:
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec, timeout_s)
        if tool.name in tools:
            raise ToolNotFound(f"agent.tools: two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def parse_tool_call(text: str, names: Sequence[str]) -> ToolCall | None:
    """The first ``<name>...</name>`` of a known tool in ``text``; ``None`` when the turn calls none."""
    tag = first_tag(text, names)
    if tag is None:
        return None
    if not tag.closed:
        return ToolCall(tag.name, tag.body, error=f"<{tag.name}> is not closed by </{tag.name}>")
    return ToolCall(tag.name, tag.body)


def run_tool(tool: Tool, arguments: str, timeout_s: float) -> ToolResult:
    """``tool(arguments)`` as a ``ToolResult``: a string is a success, an exception a failure.
    A call still running after ``timeout_s`` is abandoned (a thread cannot be killed: a tool
    that may hang should enforce the limit itself, as ``python`` does by killing its child)."""

    def call() -> ToolResult:
        try:
            out = tool(arguments)
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's observation
            return ToolResult.failed(f"{type(e).__name__}: {e}")
        return out if isinstance(out, ToolResult) else ToolResult(output=str(out))

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tool-{tool.name}")
    try:
        return pool.submit(call).result(timeout=timeout_s + GRACE_S)
    except FutureTimeout:
        return ToolResult.failed(f"timed out after {timeout_s:g} s", timed_out=True)
    finally:
        pool.shutdown(wait=False)


def load_environment_factory(spec: str) -> Callable[[dict], Environment]:
    """``agent.environment``: ``pkg.module:factory``, called with each episode's dataset row."""
    mod_name, _, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError, ValueError, SyntaxError) as e:
        raise ToolNotFound(f"agent.environment: cannot import {spec!r}: {type(e).__name__}: {e}") from e
    if not callable(factory):
        raise ToolNotFound(f"agent.environment: {spec!r} is not callable")
    return factory
