"""Scoring of the held-out eval: greedy accuracy and pass@k. Pure functions, torch-free.

``pass_at_k`` is the unbiased estimator of Chen et al. (2021, "Evaluating Large
Language Models Trained on Code"): from ``n >= k`` samples of a prompt of which
``c`` are correct, ``1 - C(n-c, k) / C(n, k)``, averaged over prompts. With
exactly ``k`` samples per prompt (what the eval draws) it is the simple any-of-k
rate: 1 when at least one of the k samples is correct, else 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu_runtime.data import reasoning_gym
from gpu_runtime.data.rewards import math_answer_reward


def is_correct(response_text: str, row: dict) -> bool:
    """The math answer rule (``reward.kind: math_answer``) on one response; a row made by
    ``data.kind: reasoning_gym`` is scored by its generator (correct: score 1)."""
    if reasoning_gym.is_gym_row(row):
        return reasoning_gym.score(response_text, row) >= 1.0
    return math_answer_reward(response_text, row)[1]


def pass_at_k_estimate(n: int, c: int, k: int) -> float:
    """P(at least one of k draws without replacement from n samples, c correct, is correct)."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    miss = 1.0  # C(n-c, k) / C(n, k) as a product, without big binomials
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def pass_at_k(correct: Sequence[Sequence[bool]], k: int | None = None) -> float:
    """Mean pass@k over prompts; ``correct[p]`` holds one flag per sample of prompt ``p``
    (each prompt needs at least ``k`` samples; ``k`` defaults to the fewest a prompt has)."""
    if not correct:
        raise ValueError("pass_at_k needs at least one prompt")
    k = min(len(row) for row in correct) if k is None else k
    return sum(pass_at_k_estimate(len(row), sum(map(bool, row)), k) for row in correct) / len(correct)


def accuracy(correct: Sequence[bool]) -> float:
    """Fraction correct (the greedy pass@1)."""
    if not correct:
        raise ValueError("accuracy needs at least one answer")
    return sum(map(bool, correct)) / len(correct)
