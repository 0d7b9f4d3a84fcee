"""The reasoning-gym scorer, run in the reward process (``sandbox``): importing this module
imports reasoning-gym, which the sandbox does in its load step, outside the per-call
timeout. A generator's ``score_answer`` is third-party code that may take unbounded time
on odd input (some parse expressions with sympy), so it gets ``reward.timeout_s`` per call
and a child the scorer can kill, as math-verify does."""

from __future__ import annotations

import reasoning_gym  # noqa: F401  (imported here so the load step, not the first call, pays for it)

from gpu_runtime.data import reasoning_gym as gym


def reasoning_gym_reward(prompt: str, response: str, row: dict) -> float:
    """The row's generator's own score of the response (0.0 .. 1.0); ValueError naming the
    row when it was not made by ``data.kind: reasoning_gym``."""
    return gym.score(response, row)
