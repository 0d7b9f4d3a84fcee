"""What the run's processes report of themselves: events, engine slots, trainer cells.

One model per thing, used by the node agent and the trainer that produce it and by the
workflow contracts that carry it into history (``milestone status`` shows it). These
models are decoded again from every recorded history, so they keep pydantic's default
(unknown keys ignored): a field may be added with a default, never removed or renamed.
The events themselves are ``spec.events``.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel


class SlotState(StrEnum):
    """An engine slot: its engine starting, serving, being torn down, or none running (recovery starts one)."""

    STARTING = "starting"
    HEALTHY = "healthy"
    DEAD = "dead"
    EMPTY = "empty"


class RankState(StrEnum):
    """A fsdp2 cell's rank: a call on the cell failed and the next call rebuilds it, or not."""

    ALIVE = "alive"
    FAILED = "failed"


class CellState(StrEnum):
    """A DP cell: training, lost (a restart is due), or restarting (it joins the next step)."""

    ALIVE = "alive"
    LOST = "lost"
    STARTING = "starting"


class EngineSlotInfo(BaseModel):
    """One rollout engine slot of a node's fleet."""

    slot: int
    pid: int | None = None
    url: str = ""
    node: str = ""  # the node id of the agent that runs it
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
    state: RankState


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
    state: CellState
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


__all__ = ["CellInfo", "CellRankInfo", "CellState", "DPCellStatus", "DPCells", "EngineSlotInfo", "RankState",
           "SlotState"]
