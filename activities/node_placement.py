"""A node claimed by a run, and the run's liveness watch on it (the shared pool queue and
the node's own queue). One run per node: a node that serves another live run is busy."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from gpu_runtime.store.fence import next_epoch
from gpu_runtime.store.uri import open_store
from workflows.contracts.placement import ClaimNodeInput, NodeClaim, NodeLivenessInput
from workflows.failures import Failure, failure
from workflows.stubs import CLAIM_NODE, NODE_LIVENESS

EXCLUDED_NODE_ATTEMPTS = 4
CLAIM_HOLD_S = 30.0  # a claimed node is busy this long for other runs, or until the claiming run's watch starts


class ClaimedNode(Protocol):
    """What a claim reads of the node (``NodeRuntime``)."""

    node_id: str
    boot_id: str

    @property
    def task_queue(self) -> str: ...

    @property
    def weights_url(self) -> str: ...

    def set_run(self, run_id: str) -> None: ...


class PlacementActivities:
    def __init__(self, node: ClaimedNode) -> None:
        self.rt = node
        self.watching: Counter[str] = Counter()  # run id -> its node_liveness watches running here
        self.claimed: dict[str, float] = {}  # run id -> when it claimed this node (until its watch starts)
        self.on_run_left: Callable[[str], None] | None = None  # a run's watch ended here (workers.node_reclaim)

    @activity.defn(name=CLAIM_NODE.name)
    def claim_node(self, inp: ClaimNodeInput) -> NodeClaim:
        if self.rt.task_queue in inp.held_queues:  # the run holds this node already (as its trainer's, say)
            raise failure(Failure.NODE_EXCLUDED, f"{self.rt.task_queue} serves {inp.run_id} already")
        # a node the run lost is left to others first; if it is the only one polling, it is
        # alive after all (it was slow, not gone), so it may take the run back
        if self.rt.task_queue in inp.exclude_queues and activity.info().attempt < EXCLUDED_NODE_ATTEMPTS:
            raise failure(Failure.NODE_EXCLUDED, f"{self.rt.task_queue} is excluded for {inp.run_id}")
        # one run per node: a node whose engines and trainer serve another live run (its
        # liveness watch runs here) is not free; the claim is retried, by a free node or later
        # (a claim holds the node for CLAIM_HOLD_S until the run's watch starts)
        now = time.monotonic()
        busy = sorted(({r for r, n in self.watching.items() if n}
                       | {r for r, t in self.claimed.items() if now - t < CLAIM_HOLD_S}) - {inp.run_id})
        if busy:
            raise failure(Failure.NODE_BUSY, f"{self.rt.node_id} ({self.rt.task_queue}) serves run {busy[0]}")
        self.claimed = {inp.run_id: now}
        self.rt.set_run(inp.run_id)
        epoch = next_epoch(open_store(inp.store_uri), inp.run_id) if inp.store_uri else 0
        return NodeClaim(node_id=self.rt.node_id, boot_id=self.rt.boot_id, task_queue=self.rt.task_queue, epoch=epoch,
                         weights_url=self.rt.weights_url)

    @activity.defn(name=NODE_LIVENESS.name)
    async def node_liveness(self, inp: NodeLivenessInput) -> None:
        """Heartbeat until the run cancels it. On the worker's event loop, not in the
        activity thread pool, so busy activities cannot delay it; a dead, stopped or
        partitioned agent stops heartbeating and the run moves (workflows/node_watch.py)."""
        self.watching[inp.run_id] += 1
        self.claimed.pop(inp.run_id, None)
        try:
            while True:
                activity.heartbeat()
                await asyncio.sleep(inp.interval_s)
        except asyncio.CancelledError:
            why = activity.cancellation_details()
            if why is not None and (why.not_found or why.timed_out):  # the run ended or moved on: not an error
                raise ApplicationError("liveness watch ended", type="WatchEnded",
                                       category=ApplicationErrorCategory.BENIGN) from None
            raise
        finally:  # the run ended or left this node
            self.watching[inp.run_id] -= 1
            self.claimed.pop(inp.run_id, None)
            if self.on_run_left is not None and not self.watching[inp.run_id]:
                self.on_run_left(inp.run_id)

    def live_runs(self) -> set[str]:
        """Runs this node serves now: watched, or claimed and not yet watched."""
        return {r for r, n in self.watching.items() if n} | set(self.claimed)
