"""A run's fence as a node's activities meet it: the store each placement writes through,
and what a write the fence refused becomes (reported to the run, then ``NodeLost``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from temporalio.exceptions import ApplicationError

from gpu_runtime.store.fence import FencedStore
from gpu_runtime.store.object_store import ObjectStore
from gpu_runtime.store.uri import open_store
from spec.event_text import event_text
from spec.events import RunEvent, StaleWriteRefused, utc_now
from workflows.failures import Failure, failure

log = logging.getLogger(__name__)


class FencedNode(Protocol):
    """Who writes (``NodeRuntime``)."""

    node_id: str

    @property
    def task_queue(self) -> str: ...


class RunFence:
    """``report`` tells a run about an event outside any activity result (a signal)."""

    def __init__(self, node: FencedNode, report: Callable[[str, RunEvent], None] | None) -> None:
        self.node = node
        self.report = report

    def store(self, run_id: str, store_uri: str, epoch: int) -> FencedStore:
        """The run's store for this placement: writes only under the run's prefix and at its epoch."""
        return self.over(open_store(store_uri), run_id, epoch)

    def over(self, store: ObjectStore, run_id: str, epoch: int) -> FencedStore:
        """``store`` (already open) as this placement of the run writes to it."""
        return FencedStore(store, run_id, epoch, self.node.node_id)

    def stale(self, run_id: str, epoch: int, message: str) -> ApplicationError:
        """A write of this node refused by the run's fence: the run has moved on (or moves now,
        when the refusal reaches a workflow that still waits). Reported to the run, then NodeLost."""
        event = StaleWriteRefused(at=utc_now(), node=self.node.node_id, epoch=epoch, error=message)
        log.warning("run %s: %s", run_id, event_text(event))
        if self.report is not None:
            self.report(run_id, event)
        return failure(Failure.NODE_LOST, f"stale placement: {event_text(event)}", self.node.task_queue)
