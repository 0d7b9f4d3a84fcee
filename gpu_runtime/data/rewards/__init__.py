"""Rewards: every ``reward.kind`` of the run config, scored where the samples are (the
node agent, ``activities/rewards.py``).

``score_samples`` is the entry point. The kinds: the integer answer rule
(``math_answer``), math-verify (``math_verify``), GSM8K answers (``gsm8k``), a
format regex (``format``), a weighted sum of kinds (``weighted``), a function by
dotted path (``custom``), a batch reward-model endpoint (``http``) and a
per-sample judge endpoint with durable results (``judge``). Torch-free.

A custom function has the signature ``fn(prompt: str, response: str, row: dict) -> float``
(``row`` is the normalized row of ``gpu_runtime.data.rows``: ``id``, ``prompt`` or
``messages``, ``answer``, ``metadata``); it runs in a child process that is killed
when a call outlives ``timeout_s``.
"""

from gpu_runtime.data.rewards.loader import RewardFn, load_reward_function
from gpu_runtime.data.rewards.rules import extract_answer, gsm8k_extract, gsm8k_reward, math_answer_reward
from gpu_runtime.data.rewards.errors import RewardError, RewardFatal, RewardFunctionNotFound
from gpu_runtime.data.rewards.scoring import ScoreContext, ScoreStats, score_samples

__all__ = [
    "RewardError", "RewardFatal", "RewardFn", "RewardFunctionNotFound", "ScoreContext", "ScoreStats",
    "extract_answer", "gsm8k_extract", "gsm8k_reward", "load_reward_function", "math_answer_reward", "score_samples",
]
