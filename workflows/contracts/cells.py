"""Trainer cells as the node's trainer reports them (fsdp2 cell ranks, torchft DP cells) and the DP-cell
restarts the run schedules (``workflows.cell_heal``)."""

from __future__ import annotations

from pydantic import BaseModel

from workflows.contracts.events import RunEvent


class CellRankInfo(BaseModel):
    rank: int
    pid: int
    node_ip: str  # the Ray node the rank runs on
    node_id: str  # Ray's node id
    state: str  # alive | failed, as of the trainer's last result


class CellInfo(BaseModel):
    """A fsdp2 cell as the node's trainer last reported it (``milestone status`` lists it)."""

    node: str  # the node agent whose trainer process drives the cell
    generation: int  # cells that trainer process built; a rebuilt cell is the next
    placement: str  # strict_pack | spread
    ray_address: str  # "local": a Ray instance the trainer process started
    ranks: list[CellRankInfo]


class DPCellStatus(BaseModel):
    """One data-parallel cell (``trainer.cells``) as the node's trainer last reported it."""

    index: int
    pid: int
    state: str  # alive | lost | starting
    why: str = ""  # why it was lost
    restarts: int = 0
    policy_version: int = 0
    state_checksum: str = ""  # weights + AdamW + schedule + version (equal on every live cell)
    healed_from_step: int | None = None  # its state was last copied from a peer (it held this version)


class DPCells(BaseModel):
    """The run's DP cells and their torchft lighthouse."""

    node: str
    lighthouse_pid: int
    lighthouse_restarts: int = 0
    cells: list[DPCellStatus]


class CellHeal(BaseModel):
    """A lost DP cell the run will restart (``workflows.cell_heal``): when, and after how
    many failed restarts (the backoff is 5 s * 2^failures, capped)."""

    lost_at: str  # ISO time the run learnt of the loss
    due_at: float  # workflow time (unix seconds) from which the next restart may run
    failures: int = 0


class RestartCellsInput(BaseModel):
    run_id: str
    store_uri: str
    cells: list[int]
    epoch: int = 0


class RestartCellsResult(BaseModel):
    outcome: dict[str, str]  # cell index -> restarting | starting | alive | no_group | failed: <why>
    node_events: list[RunEvent] = []
    dp: DPCells | None = None
