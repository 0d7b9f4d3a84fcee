"""Stateful activities served by a node agent on ``node-<node_id>-<boot_id>``, one class per
job: placement (claim, liveness watch), the run's trainer, the run's engines, rollouts
through them, and the trainer's side of a cross-host weight push.

Thin adapters: validate, call ``gpu_runtime``, heartbeat, map failures to
retryable / non-retryable errors.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from activities.fence import RunFence
from activities.node_engines import EngineActivities
from activities.node_placement import PlacementActivities
from activities.node_rollout import RolloutActivities
from activities.node_trainer import TrainerActivities
from activities.node_weight_group import WeightGroupActivities
from gpu_runtime.node.runtime import NodeRuntime
from spec.events import RunEvent


class NodeActivities:
    """What ``workers.gpu`` registers. ``report`` tells a run about an event outside any
    activity result (a signal)."""

    def __init__(self, runtime: NodeRuntime, report: Callable[[str, RunEvent], None] | None = None) -> None:
        fence = RunFence(runtime, report)
        self.placement = PlacementActivities(runtime)
        self.trainer = TrainerActivities(runtime, fence)
        self.engines = EngineActivities(runtime, self.trainer.exporter)
        self.rollout = RolloutActivities(runtime, fence)
        self.weight_group = WeightGroupActivities(runtime, self.version_folder)  # rank 0 of cross-host pushes

    def version_folder(self, run_id: str, version: int, checksum: str) -> Path:
        """The folder of a version this node's trainer holds (exported again when pruned), for the
        weight server: what the run's rollout nodes pull. ``LookupError``: not a run of this node."""
        setup = self.trainer.rt.setups.get(run_id)
        if setup is None:
            raise LookupError(f"run {run_id} is not placed on this node")
        return self.trainer.rt.local_weights.folder(setup.store_uri, run_id, version, checksum,
                                                    export=self.trainer.exporter(run_id, version))

    def all(self) -> list[Callable]:
        """The activities of this node's own queue."""
        return [self.trainer.init_policy, self.rollout.rollout, self.rollout.compute_rewards_on_node,
                self.trainer.train_step, self.engines.update_weights, self.trainer.checkpoint, self.rollout.evaluate,
                self.placement.node_liveness, self.trainer.restart_cells, self.weight_group.open_weight_group,
                self.weight_group.broadcast_weights]

    def pool(self) -> list[Callable]:
        """The activities of the shared pool queue: claiming this node for a run."""
        return [self.placement.claim_node]
