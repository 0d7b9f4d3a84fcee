"""Reward functions: the rule-based math answer check and custom functions
loaded by dotted path (``"pkg.module:fn"`` or ``"pkg.module.fn"``).

A custom function has the signature ``fn(prompt: str, response: str, row: dict) -> float``
(``row`` is the normalized row of ``gpu_runtime.data.rows``: ``id``, ``prompt`` or
``messages``, ``answer``, ``metadata``) and runs in a daemon thread with a timeout; a timeout, an exception or a
non-finite / non-numeric result raises ``RewardError`` naming the function.
A function that cannot be found at all (bad path, module not importable,
attribute missing or not callable) raises ``RewardFunctionNotFound``: that
does not change on a retry, while a call that raised may succeed on one.
Torch-free.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict

from gpu_runtime.store.artifacts import Sample, SampleReward
from gpu_runtime.data.rows import final_answer

log = logging.getLogger(__name__)

RewardFn = Callable[[str, str, dict], float]
_INT_RE = re.compile(r"-?\d+")
_HASH_RE = re.compile(r"####\s*(-?\d+)")


class RewardError(RuntimeError):
    """A reward function failed (timeout, exception, bad return value)."""


class RewardFunctionNotFound(RewardError):
    """The dotted path names no callable: malformed, module not importable,
    attribute missing or not callable. Deterministic: retrying cannot help."""


class RewardSettings(BaseModel):
    """How samples are scored: ``reward`` in the run config, which declares the
    defaults and validates (``activities.translate.reward_settings``)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["math_answer", "custom"]
    function: str | None
    timeout_s: float


def extract_answer(text: str) -> str | None:
    """The answer in a response: the integer after the last ``####`` if any,
    else the last integer in the text; ``None`` when there is none. Normalised
    (``"007"`` -> ``"7"``)."""
    hashes = _HASH_RE.findall(text)
    if hashes:
        return str(int(hashes[-1]))
    ints = _INT_RE.findall(text)
    if not ints:
        return None
    return str(int(ints[-1]))


def math_answer_reward(response_text: str, row: dict) -> tuple[float, bool]:
    """(1.0, True) when the extracted answer equals the row's final answer, else (0.0, False).
    ValueError naming the row when its label holds no integer answer."""
    got = extract_answer(response_text)
    correct = got is not None and got == final_answer(row)
    return (1.0 if correct else 0.0), correct


def _split_dotted(path: str) -> tuple[str, str]:
    """``pkg.module:fn`` or ``pkg.module.fn`` -> (module, attribute). The run config
    checks the shape; a malformed path simply fails to import here."""
    if ":" in path:
        mod, _, attr = path.partition(":")
    else:
        mod, _, attr = path.rpartition(".")
    return mod, attr


def load_reward_function(path: str) -> RewardFn:
    """Import ``pkg.module:fn`` / ``pkg.module.fn``; ``RewardFunctionNotFound`` when it cannot."""
    mod_name, attr = _split_dotted(path)
    try:
        mod = importlib.import_module(mod_name)
    except (ImportError, SyntaxError, ValueError) as e:  # ValueError: an empty module name
        raise RewardFunctionNotFound(
            f"reward function {path!r}: cannot import module {mod_name!r}: {type(e).__name__}: {e}"
        ) from e
    fn = getattr(mod, attr, None)
    if fn is None:
        raise RewardFunctionNotFound(f"reward function {path!r}: module {mod_name!r} has no callable {attr!r}")
    if not callable(fn):
        raise RewardFunctionNotFound(
            f"reward function {path!r}: {mod_name}.{attr} is not callable ({type(fn).__name__})"
        )
    return fn  # type: ignore[no-any-return]


def call_with_timeout(fn: RewardFn, name: str, timeout_s: float, prompt: str, response: str, row: dict) -> float:
    """Run ``fn(prompt, response, row)`` in a daemon thread; RewardError on timeout,
    exception, or a result that is not a finite number. (A timed-out thread
    cannot be killed; it is left to finish in the background.)"""
    result: list[object] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn(prompt, response, row))
        except BaseException as e:  # noqa: BLE001 - reported below
            error.append(e)

    t = threading.Thread(target=target, name=f"reward:{name}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise RewardError(f"reward function {name!r} timed out after {timeout_s} s")
    if error:
        e = error[0]
        raise RewardError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
    value = result[0]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RewardError(f"reward function {name!r} returned {type(value).__name__}, expected float")
    if not math.isfinite(float(value)):
        raise RewardError(f"reward function {name!r} returned non-finite value {value!r}")
    return float(value)


def score_samples(
    samples: Sequence[Sample],
    rows_by_index: Mapping[int, dict] | Sequence[dict],
    reward_spec: RewardSettings,
) -> list[SampleReward]:
    """One SampleReward per sample, in order, scored on the sample's text (its ids
    decoded by the model's tokenizer at rollout time). For ``custom`` rewards,
    ``correct`` is ``reward > 0`` unless the row's answer can be checked by the math rule."""
    fn: RewardFn | None = None
    if reward_spec.kind == "custom":
        assert reward_spec.function is not None
        fn = load_reward_function(reward_spec.function)
    out: list[SampleReward] = []
    for s in samples:
        try:
            row = rows_by_index[s.prompt_index]
        except (KeyError, IndexError):
            raise ValueError(f"sample {s.sample_id}: prompt_index {s.prompt_index} not in dataset") from None
        response = s.response_text
        if fn is None:
            reward, correct = math_answer_reward(response, row)
            detail = f"answer={extract_answer(response)!r} expected={final_answer(row)!r}"
        else:
            assert reward_spec.function is not None
            reward = call_with_timeout(fn, reward_spec.function, reward_spec.timeout_s, s.prompt_text, response, row)
            try:
                correct = math_answer_reward(response, row)[1]
            except ValueError:
                correct = reward > 0
            detail = f"custom={reward_spec.function}"
        out.append(SampleReward(sample_id=s.sample_id, reward=reward, correct=correct, detail=detail))
    return out
