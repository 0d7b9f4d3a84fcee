"""How samples are scored, as the scoring worker (the node agent) receives it, and the errors of scoring.

``RewardSettings`` mirrors the run config's ``reward`` section field for field
(``activities.translate.reward_settings`` fills in each kind's defaults, which are
declared only in the run config), so it has no defaults of its own.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Kind = Literal["math_answer", "math_verify", "gsm8k", "format", "weighted", "custom", "http", "judge", "reasoning_gym"]
ANSWER_KINDS = ("math_answer", "math_verify", "gsm8k", "reasoning_gym")  # kinds that decide a sample is correct


class RewardError(RuntimeError):
    """Scoring failed in a way a retry may fix (an endpoint down, a function that raised)."""


class RewardFatal(RewardError):
    """Scoring failed in a way a retry cannot fix: an endpoint answered 4xx or junk, a custom
    function failed under ``error_policy: fail``, a label the kind cannot read."""


class RewardFunctionNotFound(RewardFatal):
    """The dotted path names no callable: malformed, module not importable,
    attribute missing or not callable. Deterministic: retrying cannot help."""


class _Fields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Kind
    function: str | None
    timeout_s: float
    error_policy: Literal["fail", "zero"] | None
    mode: Literal["strict", "flexible"] | None
    pattern: str | None
    format_score: float | None
    url: str | None
    batch_size: int | None
    concurrency: int | None
    max_retries: int | None


class RewardTermSettings(_Fields):
    """One term of a ``weighted`` reward (``name``: its key in ``SampleReward.terms``)."""

    weight: float
    name: str


class RewardSettings(_Fields):
    terms: list[RewardTermSettings] | None

    def term_list(self) -> list[RewardTermSettings]:
        """The terms to score: a weighted reward's, or this reward as its one term of weight 1."""
        if self.kind == "weighted":
            assert self.terms
            return self.terms
        return [RewardTermSettings(**self.model_dump(exclude={"terms"}), weight=1.0, name=self.kind)]
