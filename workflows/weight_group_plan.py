"""The group of a cross-host weight push, as the workflow plans it (pure, deterministic).

One push of version v with ``engines.weight_sync: distributed`` and rollout nodes forms one
torch.distributed group: the trainer (rank 0, on the trainer's node) and the engines of the
step's live rollout nodes, node i (in slot order) from rank ``1 + i * num_engines`` on. The
group is planned per push, so it follows the fleet: a node lost or replaced, an engine count
changed (``milestone set engines.num_engines``) are simply the next push's plan. The ranks
actually used are the roster the trainer's node writes from the nodes' registrations
(``gpu_runtime.weight_sync.group_roster``): a node or an engine missing at push time is
left out of the group (and pulls the version) instead of failing it for everyone.
"""

from __future__ import annotations

from spec.engine import EngineSpec
from workflows.contracts.weight_group import GroupSeat, WeightGroupAddress, WeightGroupPlan


def group_name(run_id: str, version: int, attempt: int, nonce: str) -> str:
    """Unique per push: the run, the version, the step's attempt and a nonce of the workflow's
    (deterministic) random, so a push made again never meets a member of an older one."""
    return f"{run_id}/v{version}/a{attempt}/{nonce}"


def plan_group(name: str, queues: list[str], engines: EngineSpec) -> WeightGroupPlan:
    """The group of a push to the rollout nodes at ``queues`` (the live ones, in slot order)."""
    if not queues:
        raise ValueError("a weight group needs at least one rollout node")
    return WeightGroupPlan(name=name, nodes=len(queues), engines_per_node=engines.num_engines,
                           world_size=1 + len(queues) * engines.num_engines, timeout_s=engines.weight_sync_timeout_s)


def seats(plan: WeightGroupPlan, address: WeightGroupAddress, queues: list[str]) -> dict[str, GroupSeat]:
    """Each rollout node's seat: its index in ``queues`` (the plan's order)."""
    if len(queues) != plan.nodes:
        raise ValueError(f"group {plan.name} plans {plan.nodes} rollout nodes, not {len(queues)}")
    return {q: GroupSeat(group=plan, address=address, node=i) for i, q in enumerate(queues)}
