"""What the run's processes report of themselves: events, engine slots, trainer cells.

One model per thing, used by the node agent and the trainer that produce it and by the
workflow contracts that carry it into history (``milestone status`` shows it). These
models are decoded again from every recorded history, so they keep pydantic's default
(unknown keys ignored): a field may be added with a default, never removed or renamed.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Literal

from pydantic import BaseModel, field_validator

SlotState = Literal["starting", "healthy", "dead", "empty"]


class RunEvent(BaseModel):
    """Something that happened to the run: an engine died, a trainer was restored, a cell healed, ..."""

    at: str  # ISO 8601 time in UTC
    kind: str  # engine_dead, engine_hung, engine_restarted, engine_recovered, checksum_ok, node_lost, ...
    detail: str = ""

    @field_validator("at", mode="before")
    @classmethod
    def _iso(cls, v: object) -> object:
        """Unix seconds become the ISO time: the one place a process's clock is converted (and
        how a trainer result stored with a unix ``at`` by an older version reads)."""
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return datetime.fromtimestamp(v, timezone.utc).isoformat()
        return v

    @classmethod
    def at_time(cls, unix_s: float, kind: str, detail: str = "") -> "RunEvent":
        """The event at ``unix_s`` seconds since the epoch."""
        return cls.model_validate({"at": unix_s, "kind": kind, "detail": detail})

    @classmethod
    def now(cls, kind: str, detail: str = "") -> "RunEvent":
        return cls.at_time(time.time(), kind, detail)


class EngineSlotInfo(BaseModel):
    """One rollout engine slot of a node's fleet."""

    slot: int
    pid: int | None = None
    url: str = ""
    state: SlotState
    weight_version: int | None = None  # the policy version it serves (None: none yet, or not a version number)
    checksum: str | None = None
    restart_count: int = 0


class CellRankInfo(BaseModel):
    """One rank of a fsdp2 cell."""

    rank: int
    pid: int
    node_ip: str  # the Ray node the rank runs on
    node_id: str  # Ray's node id
    state: str  # alive | failed (a call on the cell failed; the next call rebuilds it)


class CellInfo(BaseModel):
    """A fsdp2 cell as its trainer process last reported it (``milestone status`` lists it)."""

    node: str = ""  # the node agent whose trainer process drives the cell (set by the node agent)
    generation: int  # cells that trainer process built; a rebuilt cell is the next
    placement: str  # strict_pack | spread
    ray_address: str  # "local": a Ray instance the trainer process started
    ranks: list[CellRankInfo]


class DPCellStatus(BaseModel):
    """One data-parallel cell (``trainer.cells``) as its group last saw it."""

    index: int
    pid: int
    state: str  # alive | lost | starting
    why: str = ""  # why it was lost
    restarts: int = 0
    policy_version: int = 0
    state_checksum: str = ""  # weights + AdamW + schedule + version (equal on every live cell)
    healed_from_step: int | None = None  # its state was last copied from a peer (it held this version)


class DPCells(BaseModel):
    """The trainer's DP cells and their torchft lighthouse."""

    node: str = ""  # the node agent whose trainer process runs the cells (set by the node agent)
    lighthouse_pid: int
    lighthouse_restarts: int = 0
    cells: list[DPCellStatus]
