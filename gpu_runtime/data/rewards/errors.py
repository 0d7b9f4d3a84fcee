"""The errors of scoring: what a retry may fix, and what it cannot."""

from __future__ import annotations


class RewardError(RuntimeError):
    """Scoring failed in a way a retry may fix (an endpoint down, a function that raised)."""


class RewardFatal(RewardError):
    """Scoring failed in a way a retry cannot fix: an endpoint answered 4xx or junk, a custom
    function failed under ``error_policy: fail``, a label the kind cannot read."""


class RewardFunctionNotFound(RewardFatal):
    """The dotted path names no callable: malformed, module not importable,
    attribute missing or not callable. Deterministic: retrying cannot help."""
