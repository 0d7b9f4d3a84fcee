"""When the run restarts its lost DP cells (``trainer.cells > 1``): deterministic, from
workflow time and the steps' recorded results, so replay makes the same decisions.

A cell reported lost after a step is due ``cell_restart_backoff_s`` later; each restart
that fails (or whose cell is lost again in the step it rejoined) doubles the wait, capped
at ``cell_restart_backoff_max_s`` (5 s * 2^k <= 300 s: Miles' FT controller). A due cell
is restarted by the next step, before it trains (``RLStep``); it then heals from a peer
in that step's quorum. Its peers never wait for it.
"""

from __future__ import annotations

from datetime import datetime

from spec.status import CellState, DPCells
from spec.trainer import TrainerSpec
from workflows.contracts.cells import CellHeal

# restart outcomes that end a cell's backoff: the process is starting (or was not lost); if it
# fails to start or is lost again, a later step reports it lost and the wait doubles
RECOVERED = ("restarting", "starting", "restarted", "alive", "no_group")


def backoff_s(failures: int, spec: TrainerSpec) -> float:
    return min(spec.cell_restart_backoff_s * 2 ** failures, spec.cell_restart_backoff_max_s)


def due(heal: dict[str, CellHeal], now: datetime) -> list[int]:
    """The cells whose restart may run now, by index."""
    t = now.timestamp()
    return sorted(int(i) for i, h in heal.items() if h.due_at <= t)


def after_step(heal: dict[str, CellHeal], dp: DPCells | None, restarts: dict[str, str], now: datetime,
               spec: TrainerSpec) -> dict[str, CellHeal]:
    """The backoff state once a step has committed: its restarts' outcomes applied, and every
    cell the step left lost scheduled (a cell lost again right after its restart counts as a
    failed restart)."""
    t = now.timestamp()
    out = dict(heal)
    failed_again: dict[str, int] = {}
    for i, outcome in restarts.items():
        prev = out.pop(i, None)
        failures = (prev.failures if prev else 0) + 1
        if outcome in RECOVERED:
            failed_again[i] = failures  # if the step lost it again, the next wait is longer
        else:
            out[i] = CellHeal(lost_at=prev.lost_at if prev else now.isoformat(), due_at=t + backoff_s(failures, spec),
                              failures=failures)
    for c in (dp.cells if dp else []):
        i = str(c.index)
        if c.state != CellState.LOST or i in out:
            continue
        failures = failed_again.get(i, 0)
        out[i] = CellHeal(lost_at=now.isoformat(), due_at=t + backoff_s(failures, spec), failures=failures)
    return out
