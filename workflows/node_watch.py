"""Node liveness for ``TrainingRun``: notice a lost node agent in seconds.

While a run is placed on a node, that node runs one ``node_liveness`` activity which
heartbeats every ``node.liveness_interval_s`` until it is cancelled. Work on the node
(the placement's activities, each ``RLStep`` child) is awaited together with it: when
the node stops heartbeating for ``node.liveness_timeout_s`` (a dead, stopped or
partitioned agent), or nobody picks the watch up that long, the work is cancelled and
fails as ``NodeLost``, which ``TrainingRun`` answers by re-placing the run. Without
the watch a lost node is noticed by the work's own heartbeat and schedule-to-start
timeouts (15 s each, about 30 s in all).

When the run ends (or continues as new) it cancels the watch and waits until the node
has acknowledged the cancel (``finish``), so a closed run lists no pending activity in
the UI; on a node that is gone the heartbeat timeout ends the wait.

Deterministic: only workflow APIs.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from datetime import timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, TimeoutError, TimeoutType

with workflow.unsafe.imports_passed_through():
    from spec.run import NodeSpec
    from workflows.contracts.placement import NodeLivenessInput
    from workflows.failures import Failure, failure
    from workflows.stubs import NODE_LIVENESS

T = TypeVar("T")


class NodeWatch:
    def __init__(self) -> None:
        self.handle: workflow.ActivityHandle | None = None
        self.queue: str | None = None

    def _watch(self, run_id: str, queue: str, spec: NodeSpec) -> workflow.ActivityHandle:
        """The node's running watch (started on first use and after a re-placement)."""
        if self.handle is not None and self.queue == queue:
            return self.handle  # running, or ended: then the caller sees why
        self.stop()
        timeout = timedelta(seconds=spec.liveness_timeout_s)
        self.queue = queue
        # a cancel completes when the node acknowledges it (or the heartbeat times out):
        # ``finish`` waits for that; ``stop`` does not
        self.handle = NODE_LIVENESS.with_timeouts(heartbeat=timeout, schedule_to_start=timeout).start(
            NodeLivenessInput(run_id=run_id, interval_s=spec.liveness_interval_s), queue=queue,
            summary=f"liveness of {queue} (timeout {spec.liveness_timeout_s:g}s)",
        )
        return self.handle

    def start(self, run_id: str, queue: str, spec: NodeSpec) -> None:
        """Watch ``queue`` from now on, with nothing awaited on it (a rollout node between steps)."""
        if spec.liveness_timeout_s > 0:
            self._watch(run_id, queue, spec)

    def ended(self) -> bool:
        """Whether the watch ended on its own: the node stopped answering (or its watch failed)."""
        return self.handle is not None and self.handle.done()

    def stop(self) -> None:
        if self.handle is not None and not self.handle.done():
            self.handle.cancel()
        elif self.handle is not None and not self.handle.cancelled():
            self.handle.exception()  # ended on its own (the node was lost): seen, not an unretrieved error
        self.handle = self.queue = None

    async def finish(self) -> None:
        """Stop the watch and wait until it has ended, bounded by its heartbeat timeout:
        the run closes with no pending activity."""
        handle = self.handle
        self.stop()
        if handle is not None:
            with contextlib.suppress(ActivityError, asyncio.CancelledError):
                await handle

    async def on_live_node(self, run_id: str, queue: str, spec: NodeSpec, work: Awaitable[T]) -> T:
        """``work`` (on node ``queue``), cancelled and turned into ``NodeLost`` as soon
        as the node stops answering."""
        if spec.liveness_timeout_s <= 0:
            return await work
        task = asyncio.ensure_future(work)
        while True:
            watch = self._watch(run_id, queue, spec)
            await workflow.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            cause = _cause(watch)
            if not (isinstance(cause, TimeoutError) and cause.type == TimeoutType.START_TO_CLOSE):
                break
            self.handle = None  # outlived its start-to-close timeout (stubs.WATCH_LIFETIME): start another
        task.cancel()
        try:
            await task
        except (Exception, asyncio.CancelledError):  # cancelled mid-way: the node is gone, whatever it says
            pass
        self.handle = self.queue = None
        if isinstance(cause, TimeoutError):
            why = f"no liveness heartbeat for {spec.liveness_timeout_s:g}s ({cause.type.name.lower() if cause.type else 'unknown'} timeout)"
        else:
            why = "its liveness watch ended" + (f": {type(cause).__name__}: {cause}" if cause else "")
        raise failure(Failure.NODE_LOST, f"node queue {queue}: {why}", queue)


def _cause(watch: workflow.ActivityHandle) -> BaseException | None:
    if watch.cancelled():
        return None
    err = watch.exception()
    return err.cause if isinstance(err, ActivityError) and err.cause is not None else err
