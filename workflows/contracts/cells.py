"""The DP-cell restarts the run schedules (``workflows.cell_heal``); the cells themselves, as the
node's trainer reports them, are ``spec.status`` models."""

from __future__ import annotations

from pydantic import BaseModel

from spec.events import RunEvent
from spec.placement import Placed
from spec.status import DPCells


class CellHeal(BaseModel):
    """A lost DP cell the run will restart (``workflows.cell_heal``): when, and after how
    many failed restarts (the backoff is 5 s * 2^failures, capped)."""

    lost_at: str  # ISO time the run learnt of the loss
    due_at: float  # workflow time (unix seconds) from which the next restart may run
    failures: int = 0


class RestartCellsInput(Placed):
    cells: list[int]


class RestartCellsResult(BaseModel):
    outcome: dict[str, str]  # cell index -> restarting | starting | alive | no_group | failed: <why>
    node_events: list[RunEvent] = []
    dp: DPCells | None = None
