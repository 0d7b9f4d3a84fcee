"""The base of every run-config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    """Also the workflow input: histories are decoded again on replay and on every
    query, so a validator may be loosened but never tightened."""

    model_config = ConfigDict(extra="forbid", frozen=False)
