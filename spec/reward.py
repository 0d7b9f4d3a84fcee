"""The ``reward`` section of the run config: every reward kind's fields, validated per
field (docs/rewards.md). Torch-free; part of the workflow input (``spec.run``), and what the
scoring code reads (``RewardSpec.term_list``)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from spec.strict import Strict

# the kinds each kind-specific field applies to (unset elsewhere), and its default where it applies
_REWARD_FIELD_KINDS: dict[str, tuple[str, ...]] = {
    "error_policy": ("custom",),
    "mode": ("gsm8k",),
    "pattern": ("format",),
    "format_score": ("gsm8k", "format"),
    "url": ("http", "judge"),
    "batch_size": ("http",),
    "concurrency": ("judge",),
    "max_retries": ("http", "judge"),
}
_REWARD_DEFAULTS: dict[str, dict[str, object]] = {
    "error_policy": {"custom": "fail"},
    "mode": {"gsm8k": "strict"},
    "format_score": {"gsm8k": 0.0, "format": 1.0},
    "batch_size": {"http": 32},
    "concurrency": {"judge": 4},
    "max_retries": {"http": 5, "judge": 5},
}
_REQUIRED: dict[str, tuple[str, ...]] = {"pattern": ("format",), "url": ("http", "judge")}


class _RewardFields(Strict):
    """What one reward kind needs. Kind-specific fields stay unset (null) for other kinds, and
    take their default (``_REWARD_DEFAULTS``) for their own kind, so a stored config of an
    older version (which had none of them) reads unchanged."""

    kind: Literal[
        "math_answer", "math_verify", "gsm8k", "format", "weighted", "custom", "http", "judge", "reasoning_gym"
    ] = Field(
        "math_answer", description="which reward; see docs/rewards.md"
    )
    function: str | None = Field(
        None, description="custom: 'pkg.module:fn' with signature fn(prompt: str, response: str, row: dict) -> float"
    )
    timeout_s: float = Field(
        10.0, gt=0, description="custom / math_verify / reasoning_gym: per call; http: per batch request; judge: per request"
    )
    error_policy: Literal["fail", "zero"] | None = Field(
        None, validate_default=True,
        description="custom: a call that raises, times out or returns junk fails the run (fail) or scores 0 (zero)",
    )
    mode: Literal["strict", "flexible"] | None = Field(
        None, validate_default=True,
        description="gsm8k: strict = the number after '#### '; flexible = the last number in the response",
    )
    pattern: str | None = Field(
        None, validate_default=True, description="format: a regex the whole response must match (re.DOTALL)"
    )
    format_score: float | None = Field(
        None, validate_default=True,
        description="format: the reward of a matching response (1.0); gsm8k: of an answer found but wrong (0.0)",
    )
    url: str | None = Field(None, validate_default=True, description="http / judge: the endpoint (http:// or https://)")
    batch_size: int | None = Field(None, ge=1, validate_default=True, description="http: samples per request (32)")
    concurrency: int | None = Field(
        None, ge=1, validate_default=True, description="judge: requests in flight at once (4)"
    )
    max_retries: int | None = Field(
        None, ge=0, validate_default=True,
        description="http / judge: retries of a request after a 5xx or a connection error, with backoff (5)",
    )

    @field_validator("function")
    @classmethod
    def _dotted(cls, v: str | None) -> str | None:
        # shape only (importing it is the CLI's pre-flight and the scoring node agent's job)
        if v is not None:
            mod, _, attr = v.partition(":") if ":" in v else v.rpartition(".")
            if not (mod and all(p.isidentifier() for p in mod.split(".")) and attr.isidentifier()):
                raise ValueError(f"{v!r} must look like 'pkg.module:fn' (or 'pkg.module.fn')")
        return v

    @field_validator(*_REWARD_FIELD_KINDS)
    @classmethod
    def _for_kind(cls, v: object, info: ValidationInfo) -> object:
        kind = info.data.get("kind")
        if kind is None:  # the kind itself is invalid: reported there
            return v
        field = info.field_name
        assert field is not None
        kinds = _REWARD_FIELD_KINDS[field]
        if v is not None and kind not in kinds:
            raise ValueError(f"applies to kind {' / '.join(kinds)}, not {kind!r} (remove it)")
        required = _REQUIRED.get(field, ())
        if v is None and kind in required:
            raise ValueError(f"required when kind is {kind!r}")
        if field == "pattern" and v is not None:
            try:
                re.compile(str(v))
            except re.error as err:
                raise ValueError(f"invalid regular expression {v!r}: {err}") from None
        if field == "url" and v is not None and not str(v).startswith(("http://", "https://")):
            raise ValueError(f"{v!r} must start with http:// or https://")
        return v

    @model_validator(mode="after")
    def _fn(self) -> _RewardFields:
        if self.kind == "custom" and not self.function:
            raise ValueError("function is required when kind is 'custom'")
        return self

    def resolved(self) -> dict[str, Any]:
        """The fields with each kind-specific default filled in for this kind."""
        out = self.model_dump(exclude={"terms"})
        for field, defaults in _REWARD_DEFAULTS.items():
            if out[field] is None and self.kind in defaults:
                out[field] = defaults[self.kind]
        return out


class RewardTerm(_RewardFields):
    """One term of a ``weighted`` reward: any kind but ``weighted``, and its weight."""

    weight: float = Field(1.0, description="the term's weight in the sum")
    name: str | None = Field(
        None, min_length=1, description="the term's name in the per-sample record (default: its kind)"
    )

    @field_validator("kind")
    @classmethod
    def _not_nested(cls, v: str) -> str:
        if v == "weighted":
            raise ValueError("a term of a weighted reward cannot itself be weighted")
        return v

    @property
    def label(self) -> str:
        return self.name or self.kind

    def resolved(self) -> dict[str, Any]:
        return {**super().resolved(), "weight": self.weight, "name": self.label}


class RewardSpec(_RewardFields):
    """How samples are scored (docs/rewards.md). ``math_answer``: the integer answer rule.
    ``math_verify``: the math-verify package. ``gsm8k``: the '#### <number>' answer, strict or
    flexible. ``format``: a regex. ``weighted``: a weighted sum of ``terms``. ``custom``: a
    function by dotted path. ``http``: a batch reward-model endpoint. ``judge``: a per-sample
    endpoint whose results are recorded durably before use."""

    terms: list[RewardTerm] | None = Field(
        None, validate_default=True, description="weighted: the terms, each {kind: ..., weight: ...}"
    )

    @field_validator("terms")
    @classmethod
    def _terms(cls, v: list[RewardTerm] | None, info: ValidationInfo) -> list[RewardTerm] | None:
        kind = info.data.get("kind")
        if kind is None:
            return v
        if kind != "weighted":
            if v is not None:
                raise ValueError(f"applies to kind weighted, not {kind!r} (remove it)")
            return v
        if not v:
            raise ValueError("required when kind is 'weighted': a list of {kind: ..., weight: ...}")
        names = [t.label for t in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"term names must be unique, {dup} repeat (give each a `name`)")
        return v

    def kinds(self) -> set[str]:
        """Every kind this reward uses (a weighted reward's terms included)."""
        return {self.kind, *(t.kind for t in self.terms or [])}

    def term_list(self) -> list[RewardTerm]:
        """The terms to score, each with its name and each kind-specific field at its kind's
        default where unset: a weighted reward's terms, or this reward as its one term of weight 1."""
        # the values are this validated section's own, or each kind's declared default: not validated again
        if self.kind == "weighted":
            assert self.terms
            return [RewardTerm.model_construct(**t.resolved()) for t in self.terms]
        return [RewardTerm.model_construct(**self.resolved(), weight=1.0, name=self.kind)]
