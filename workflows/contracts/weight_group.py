"""A cross-host weight push (``engines.weight_sync: distributed`` with rollout nodes): the group
the workflow plans, where it meets, and each side's part in it (``workflows.weight_broadcast``)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class WeightGroupPlan(BaseModel):
    """One push's group as the workflow plans it: the trainer (rank 0) and the engines of the
    rollout nodes ``0..nodes-1`` (the step's live ones, in slot order). The actual ranks are the
    roster the trainer's node writes from what each node registers
    (``gpu_runtime.weight_sync.group_roster``); with every engine present they are the plan's:
    node i's from ``1 + i * engines_per_node`` on, ``world_size`` in all."""

    name: str  # unique per push: the run, the version and this attempt of the step
    nodes: int = Field(ge=1)  # rollout nodes the trainer's node waits for
    engines_per_node: int = Field(ge=1)  # engines.num_engines
    world_size: int = Field(ge=2)  # 1 + nodes * engines_per_node
    timeout_s: float = Field(gt=0)  # engines.weight_sync_timeout_s: every wait of the group is bounded by it

    def first_rank(self, node: int) -> int:
        """Node ``node``'s first rank when every engine joins."""
        return 1 + node * self.engines_per_node


class WeightGroupAddress(BaseModel):
    """Where the group meets: the store the trainer node's agent hosts for it."""

    master_address: str  # the trainer node's advertised address (its weight server's host)
    master_port: int


class OpenWeightGroupInput(BaseModel):
    run_id: str
    group: WeightGroupPlan


class BroadcastWeightsInput(BaseModel):
    """The trainer's side: rank 0 of ``group`` sends ``policy_version`` (which its trainer must hold)."""

    run_id: str
    store_uri: str
    policy_version: int
    checksum: str
    group: WeightGroupPlan
    address: WeightGroupAddress


class BroadcastWeightsResult(BaseModel):
    """What the trainer's side saw: the roster it wrote and how the broadcast went. An outcome,
    not an error: the rollout nodes the broadcast did not reach pull the version instead."""

    policy_version: int
    world_size: int = 0  # 0: no broadcast (``error`` says why)
    backend: str = ""
    nodes: list[int] = []  # the rollout nodes in the roster
    nbytes: int = 0
    join_seconds: float = 0.0
    broadcast_seconds: float = 0.0
    seconds: float = 0.0
    error: str = ""


class GroupSeat(BaseModel):
    """A rollout node's part in a push (``UpdateWeightsInput.group``): it is node ``node`` of ``group``."""

    group: WeightGroupPlan
    address: WeightGroupAddress
    node: int = Field(ge=0)
