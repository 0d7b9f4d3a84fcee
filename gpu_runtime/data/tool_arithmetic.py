"""The calculator task: arithmetic on numbers too large to do in one's head, as chat rows
for agent episodes (``rollout.agent``, docs/agents.md).

Each row is a chat ``[system, user]``: the system message tells the model it may call
``<calculator>EXPR</calculator>``; the user asks ``"What is 4837261*9182736?"``. The label is
``"#### <product>"``. ``metadata.sft_target`` holds a demonstration of the whole episode in
ChatML (the template of ``model.init`` models and Qwen): the call, the tool's answer, the
final answer. The SFT warm-up trains on it (``rows.sft_target``) so a small model learns the
call format before RL; RL episodes then generate their own calls, and only the model's
tokens are trained (tool turns are loss-masked). Pure Python, deterministic in the seed.
"""

from __future__ import annotations

import json
import random

from gpu_runtime.data.arithmetic import _apply, _check
from gpu_runtime.store.artifacts import derive_seed

SYSTEM = "Use the calculator: write <calculator>EXPRESSION</calculator>, read its result, then answer with the number."
SYSTEM_HERMES = ('Use the calculator: write <tool_call>{"name": "calculator", "arguments": {"expression": EXPRESSION}}'
                 "</tool_call>, several in one turn when they do not depend on each other, read the results, "
                 "then answer with the number.")


def demonstration(expression: str, value: int, tool_role: str = "tool") -> str:
    """The episode a model should produce, in ChatML, after the prompt's ``<|im_start|>assistant\\n``:
    the call, the tool turn, the answer (EOS is added by the SFT step)."""
    return (f"<calculator>{expression}</calculator><|im_end|>\n<|im_start|>{tool_role}\n{value}<|im_end|>\n"
            f"<|im_start|>assistant\n{value}")


def hermes_call(expression: str) -> str:
    """A calculator call as Hermes / Qwen2.5 write it (what ``tool_parsers``' hermes parser reads and
    its ``render_call`` writes: tests/unit/test_agent_two_calls.py checks they agree)."""
    return f"<tool_call>\n{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}\n</tool_call>"


def two_call_demonstration(first: str, second: str, a: int, b: int, tool_role: str = "tool") -> str:
    """``first + second`` in hermes calls, in ChatML: both products called in ONE turn (two
    ``<tool_call>`` blocks, answered by two tool messages in order), then their sum, then the answer."""
    call = hermes_call
    total = a + b
    return (f"{call(first)}\n{call(second)}<|im_end|>\n<|im_start|>{tool_role}\n{a}<|im_end|>\n"
            f"<|im_start|>{tool_role}\n{b}<|im_end|>\n<|im_start|>assistant\n{call(f'{a}+{b}')}<|im_end|>\n"
            f"<|im_start|>{tool_role}\n{total}<|im_end|>\n<|im_start|>assistant\n{total}")


def generate_tool_arithmetic(
    n: int, seed: int, max_operand: int = 99_999_999, ops: str = "*", *, min_operand: int = 1_000_000,
    terms: int = 1, tool_format: str = "tags",
) -> list[dict]:
    """``n`` calculator rows ``a<op>b`` with ``min_operand <= a, b <= max_operand`` (default: 7-8
    digit multiplication), deterministic in ``seed``. ``terms=2``: ``a<op>b + c<op>d``, whose
    demonstration makes both calls in one turn (hermes format). ``tool_format``: how the system
    message and the demonstration write a call (``tags`` or ``hermes``)."""
    _check(n, max_operand, ops, min_operand)
    if terms == 2 and tool_format != "hermes":
        raise ValueError("terms 2 (two calls in one turn) needs tool_format hermes: a tags turn makes one call")
    rng = random.Random(derive_seed("tool_arithmetic", seed))
    system = SYSTEM_HERMES if tool_format == "hermes" else SYSTEM
    rows = []
    for i in range(n):
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        op = ops[rng.randrange(len(ops))]
        value = _apply(a, op, b)
        question, expr = f"{a}{op}{b}", f"{a}{op}{b}"
        if tool_format == "hermes":
            target = demonstration_hermes(expr, value)
        else:
            target = demonstration(expr, value)
        if terms == 2:
            c, d = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
            op2 = ops[rng.randrange(len(ops))]
            second = _apply(c, op2, d)
            question = f"{a}{op}{b} + {c}{op2}{d}"
            target = two_call_demonstration(expr, f"{c}{op2}{d}", value, second)
            value += second
        rows.append({
            "id": f"calc-{seed}-{i:06d}",
            "prompt": None,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"What is {question}?"}],
            "answer": f"#### {value}",
            "metadata": {"sft_target": target},
        })
    return rows


def demonstration_hermes(expression: str, value: int, tool_role: str = "tool") -> str:
    """``demonstration`` with the call written as a hermes ``<tool_call>`` block."""
    call = hermes_call(expression)
    return (f"{call}<|im_end|>\n<|im_start|>{tool_role}\n{value}<|im_end|>\n"
            f"<|im_start|>assistant\n{value}")
