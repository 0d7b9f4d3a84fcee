"""A ReAct-style agent written with the ``openai`` SDK, trained by Milestone as it is.

Milestone calls ``run(base_url, api_key, row)`` once per episode, in a child process of the node
agent, with an OpenAI-compatible endpoint that serves the policy being trained
(``rollout.agent.kind: openai``, docs/agents.md). The loop is the usual one: ask the model,
run the tools it calls, send their answers back, until it answers without a call. Nothing in
it knows about RL: the endpoint records every call's tokens and logprobs, and the run's reward
scores what ``run`` returns.

Config (examples/agent_openai.yaml)::

    rollout:
      agent: {kind: openai, entrypoint: "examples.agents.react_calculator:run", max_calls: 4}
"""

from __future__ import annotations

import ast
import json
import operator
from typing import Any

from openai import OpenAI

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """The agent's own tool: arithmetic on numbers, read with ``ast`` (never ``eval``)."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(result)) if float(result).is_integer() else str(result)


def run(base_url: str, api_key: str, row: dict[str, Any]) -> str:
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict[str, Any]] = list(row.get("messages") or [{"role": "user", "content": row["prompt"]}])
    for _ in range(4):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:  # every call of the turn, in order, one tool message each
            arguments = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculator(str(arguments.get("expression", "")))})
    return ""
