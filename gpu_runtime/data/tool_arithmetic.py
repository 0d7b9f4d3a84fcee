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

import random

from gpu_runtime.data.arithmetic import _apply, _check
from gpu_runtime.store.artifacts import derive_seed

SYSTEM = "Use the calculator: write <calculator>EXPRESSION</calculator>, read its result, then answer with the number."


def demonstration(expression: str, value: int, tool_role: str = "tool") -> str:
    """The episode a model should produce, in ChatML, after the prompt's ``<|im_start|>assistant\\n``:
    the call, the tool turn, the answer (EOS is added by the SFT step)."""
    return (f"<calculator>{expression}</calculator><|im_end|>\n<|im_start|>{tool_role}\n{value}<|im_end|>\n"
            f"<|im_start|>assistant\n{value}")


def generate_tool_arithmetic(
    n: int, seed: int, max_operand: int = 99_999_999, ops: str = "*", *, min_operand: int = 1_000_000
) -> list[dict]:
    """``n`` calculator rows ``a<op>b`` with ``min_operand <= a, b <= max_operand`` (default: 7-8
    digit multiplication), deterministic in ``seed``."""
    _check(n, max_operand, ops, min_operand)
    rng = random.Random(derive_seed("tool_arithmetic", seed))
    rows = []
    for i in range(n):
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        op = ops[rng.randrange(len(ops))]
        value = _apply(a, op, b)
        rows.append({
            "id": f"calc-{seed}-{i:06d}",
            "prompt": None,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a}{op}{b}?"}],
            "answer": f"#### {value}",
            "metadata": {"sft_target": demonstration(f"{a}{op}{b}", value)},
        })
    return rows
