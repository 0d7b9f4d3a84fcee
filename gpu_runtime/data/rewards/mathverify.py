"""``reward.kind: math_verify``: answer checking with Hugging Face's ``math-verify``
(the check itself is ``mathverify_call.math_verify_reward``, which imports the package).

It parses LaTeX and plain expressions (``\\boxed{..}``, fractions, sets, intervals,
units) and compares them symbolically with sympy. Its own timeouts use
``signal.alarm``, which works only in a process's main thread, and sympy can take
unbounded time on odd input, so it runs in the reward sandbox
(``gpu_runtime.data.rewards.sandbox``): the main thread of a child process that
the scorer kills when a call outlives ``reward.timeout_s``.
"""

from __future__ import annotations

import importlib.util

CALL = "gpu_runtime.data.rewards.mathverify_call:math_verify_reward"  # what the sandbox runs

MISSING = (
    "reward.kind: math_verify needs the math-verify package on the worker that scores (the node agent) "
    "(pip install 'math-verify==0.9.0', or install milestone with its dependencies)"
)


def available() -> bool:
    return importlib.util.find_spec("math_verify") is not None


def gold_text(label: str) -> str:
    """The part of a label to verify against: what follows its last ``####`` (GSM8K), else all of it."""
    _, sep, tail = label.rpartition("####")
    return (tail if sep else label).strip()
