"""The task queues: one control queue (workflows and CPU activities), two shared pool
queues on which node agents are claimed for runs (as a run's trainer node; as one of its
rollout nodes: rollout-only agents poll only this one), and one queue per node agent incarnation
(``node-<node_id>-<boot_id>``, named by ``workers.gpu``) for its stateful work."""

from __future__ import annotations

from enum import StrEnum

CONTROL_QUEUE = "milestone-control"
POOL_QUEUE = "milestone-gpu-pool"
ROLLOUT_POOL_QUEUE = "milestone-rollout-pool"  # claims of rollout nodes (engines.nodes): any agent, trainer or not


class QueueKind(StrEnum):
    """Where an activity runs (``workflows.stubs``)."""

    CONTROL = "control"  # CONTROL_QUEUE: served by every control worker
    POOL = "pool"  # POOL_QUEUE: any free node agent that can train
    ROLLOUT_POOL = "rollout_pool"  # ROLLOUT_POOL_QUEUE: any free node agent, rollout-only agents too
    NODE = "node"  # the run's node: its engines and trainer (the caller names the queue)
