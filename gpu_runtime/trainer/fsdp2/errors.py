"""Why a fsdp2 cell cannot take another step (``CellFailed`` and its kinds), importable
without Ray or torch.distributed."""

from __future__ import annotations

from typing import ClassVar

from spec.events import CellFailureKind


class CellFailed(RuntimeError):
    """The cell cannot take another step: the call fails (retryably) and the next call
    rebuilds the cell from the last durable checkpoint plus replay. ``kind`` is the run
    event the trainer reports once a rebuilt cell answers."""

    kind: ClassVar[CellFailureKind] = "cell_failed"


class CellRankDied(CellFailed):
    """A rank's actor is gone (killed, crashed, its node lost)."""

    kind: ClassVar[CellFailureKind] = "cell_rank_died"


class CellRankHung(CellFailed):
    """A rank did not answer: a collective timed out on its peers (``trainer.collective_timeout_s``),
    or the driver's bounded wait for the last ranks ran out (a rank stopped, e.g. SIGSTOP)."""

    kind: ClassVar[CellFailureKind] = "cell_rank_hung"


class CellPlacementFailed(CellFailed):
    """The cell's placement group was not satisfied in time: the cluster lacks the resources."""

    kind: ClassVar[CellFailureKind] = "cell_placement_failed"


class RayUnavailable(CellFailed):
    """The Ray cluster cannot be reached (an existing cluster's head stopped or restarted):
    the next call reconnects."""

    kind: ClassVar[CellFailureKind] = "ray_unavailable"


__all__ = ["CellFailed", "CellPlacementFailed", "CellRankDied", "CellRankHung", "RayUnavailable"]
