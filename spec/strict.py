"""The base of every run-config section, and how a section's validation errors read."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, ValidationError


class Strict(BaseModel):
    """Also the workflow input: histories are decoded again on replay and on every
    query, so a validator may be loosened but never tightened."""

    model_config = ConfigDict(extra="forbid", frozen=False)


def format_validation_error(err: ValidationError, where: Callable[[tuple], str | None] | None = None) -> str:
    """One ``key.path: message`` line per error of a pydantic ``ValidationError``.

    ``where(loc)`` may prefix a line with the error's origin (the CLI passes one
    that returns ``file:line``); the workflow names only the key path.
    """
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        origin = where(loc) if where is not None else None
        lines.append(f"{origin}: {key}: {msg}" if origin else f"{key}: {msg}")
    return "\n".join(lines)
