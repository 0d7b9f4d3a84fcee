"""A run's events: what happened, when, as the activities and workflows report it."""

from __future__ import annotations

from pydantic import BaseModel


class RunEvent(BaseModel):
    at: str
    kind: str  # engine_dead, engine_hung, engine_restarted, engine_recovered, checksum_ok, node_lost, ...
    detail: str = ""
