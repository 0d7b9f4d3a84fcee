"""A trained version pushed to the run's rollout nodes (``engines.nodes`` > 0).

- ``push_to_rollout_nodes``: ``update_weights`` on every live rollout node at once, each
  pulling the version from the trainer node's weight server (``UpdateWeightsInput.source_url``);
- ``broadcast_to_rollout_nodes`` (``engines.weight_sync: distributed``): the trainer broadcasts
  the version from memory to the engines of every rollout node over one torch.distributed
  group formed for this push (``workflows.weight_group_plan``): ``open_weight_group`` on the
  trainer's node (its agent hosts the group's store and says where), then at once
  ``broadcast_weights`` there (rank 0) and ``update_weights`` with a seat on each rollout node.
  An engine the group does not reach pulls the version instead, on its node, within the
  group's timeouts; a group that cannot be opened at all is the plain pull push.

Either way every engine's checksum is compared with the trainer's, and a node lost meanwhile is
dropped (the run replaces it at the next step boundary).
"""

from __future__ import annotations

import asyncio
import contextlib

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows.contracts.step import RLStepInput
    from workflows.contracts.training import UpdateWeightsInput, UpdateWeightsResult
    from workflows.contracts.weight_group import BroadcastWeightsInput, BroadcastWeightsResult, OpenWeightGroupInput
    from workflows.failures import Failure, failure_in
    from workflows.step_nodes import StepNodes
    from workflows.stubs import BROADCAST_WEIGHTS, OPEN_WEIGHT_GROUP, UPDATE_WEIGHTS
    from workflows.weight_group_plan import group_name, plan_group, seats


async def push_to_rollout_nodes(
    nodes: StepNodes, update: UpdateWeightsInput, summary: str, inputs: dict[str, UpdateWeightsInput] | None = None,
) -> UpdateWeightsResult:
    """``update`` (or a node's own in ``inputs``) on every live rollout node at once; a node lost
    meanwhile is dropped (the run replaces it at the next step boundary, and the new one serves
    nothing before it holds the run's version). Their results as one."""
    stub = nodes.stub(UPDATE_WEIGHTS)
    started = workflow.now()
    pushed = await nodes.on_each({
        q: asyncio.ensure_future(stub.run(inputs[q] if inputs else update, queue=q, summary=f"{summary} on {q}"))
        for q in nodes.live
    })
    if not pushed:
        raise nodes.none_left(summary)
    results = list(pushed.values())
    return UpdateWeightsResult(
        policy_version=update.policy_version,
        restarted_slots=[i for r in results for i in r.restarted_slots],
        engines=[e for r in results for e in r.engines],
        seconds=(workflow.now() - started).total_seconds(),
        node_events=[e for r in results for e in r.node_events],
    )


async def broadcast_to_rollout_nodes(
    inp: RLStepInput, nodes: StepNodes, update: UpdateWeightsInput, summary: str,
) -> UpdateWeightsResult:
    """``update``'s version broadcast by the trainer to the live rollout nodes' engines."""
    queues = list(nodes.live)
    if not queues:
        raise nodes.none_left(summary)
    version = update.policy_version
    name = group_name(inp.run_id, version, workflow.info().attempt, workflow.uuid4().hex[:8])
    plan = plan_group(name, queues, update.engines)
    try:
        address = await OPEN_WEIGHT_GROUP.run(OpenWeightGroupInput(run_id=inp.run_id, group=plan),
                                              queue=inp.node_queue, summary=f"open weight group {name}")
    except (ActivityError, ApplicationError) as err:
        kind, message = failure_in(err)
        if kind == Failure.NODE_LOST:  # the trainer's node: the step is re-placed
            raise
        workflow.logger.warning("no weight group for v%d (%s): the rollout nodes pull it", version, message)
        return await push_to_rollout_nodes(nodes, update, summary)
    sender = asyncio.ensure_future(BROADCAST_WEIGHTS.run(
        BroadcastWeightsInput(run_id=inp.run_id, store_uri=update.store_uri, policy_version=version,
                              checksum=update.checksum, group=plan, address=address),
        queue=inp.node_queue, summary=f"broadcast v{version} to {plan.nodes} rollout nodes ({plan.world_size} ranks)",
    ))
    inputs = {q: update.model_copy(update={"group": seat}) for q, seat in seats(plan, address, queues).items()}
    try:
        result = await push_to_rollout_nodes(nodes, update, f"{summary} (group {name})", inputs)
    except BaseException:
        if not sender.done():
            sender.cancel()
            with contextlib.suppress(BaseException):
                await sender
        raise
    sent = await _outcome(sender, version)
    if sent.error:
        workflow.logger.warning("broadcast of v%d: %s (the nodes it did not reach pulled it)", version, sent.error)
    return result


async def _outcome(sender: asyncio.Future[BroadcastWeightsResult], version: int) -> BroadcastWeightsResult:
    """The trainer side's outcome; a failure of the activity itself is one too (the rollout nodes
    already have the version, however it came), except a lost trainer node."""
    try:
        return await sender
    except (ActivityError, ApplicationError) as err:
        kind, message = failure_in(err)
        if kind == Failure.NODE_LOST:
            raise
        return BroadcastWeightsResult(policy_version=version, error=message)
