"""The task queues: one control queue (workflows and CPU activities), one shared pool
queue on which node agents claim runs, and one queue per node agent incarnation
(``node-<node_id>-<boot_id>``, named by ``workers.gpu``) for its stateful work."""

from __future__ import annotations

from enum import StrEnum

CONTROL_QUEUE = "milestone-control"
POOL_QUEUE = "milestone-gpu-pool"


class QueueKind(StrEnum):
    """Where an activity runs (``workflows.stubs``)."""

    CONTROL = "control"  # CONTROL_QUEUE: served by every control worker
    POOL = "pool"  # POOL_QUEUE: any free node agent
    NODE = "node"  # the run's node: its engines and trainer (the caller names the queue)
