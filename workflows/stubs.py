"""Typed activity stubs: one declaration per activity, the only place that names it.

A stub carries the activity's registered name, its input and output models, the kind
of task queue it runs on and its timeouts and retry policy. Workflows call an activity
through its stub (``await TRAIN_STEP.run(inp, queue=node, summary=...)``), and the
implementation registers under the stub's name (``@activity.defn(name=TRAIN_STEP.name)``),
so a reader or a tool follows a parameter from the workflow into the activity, and
tests/unit/test_activity_stubs.py checks that the implementations' annotations are the
stubs' types.

Node-queue activities have a short schedule-to-start timeout: when a node agent is gone
nobody polls its queue, the timeout fires, and the workflow re-places the work (Temporal
does not move work between queues on its own). ``run`` turns that timeout, and a
heartbeat timeout, into ``NodeLost``.

Names, inputs and options are part of every recorded history: changing one breaks the
replay of tests/histories/ (tests/unit/test_replay_recorded.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Generic, TypeVar

from pydantic import BaseModel
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, TimeoutError, TimeoutType
from temporalio.workflow import ActivityCancellationType

from workflows.contracts import cells, placement, sampling, training, weight_group
from workflows.failures import NON_RETRYABLE, Failure, failure
from workflows.queues import CONTROL_QUEUE, POOL_QUEUE, ROLLOUT_POOL_QUEUE, QueueKind

In = TypeVar("In", bound=BaseModel)
Out = TypeVar("Out")


@dataclass(kw_only=True, eq=False)
class ActivityStub(Generic[In, Out]):
    """One activity as the workflows see it. Not frozen only so that a test can shorten a
    timeout with ``monkeypatch.setattr``; nothing else changes a stub."""

    name: str
    input: type[In]
    output: type[Out] | None  # None: the activity returns nothing (node_liveness)
    queue: QueueKind
    start_to_close: timedelta
    heartbeat: timedelta | None = None
    schedule_to_start: timedelta | None = None
    retry: RetryPolicy
    cancellation: ActivityCancellationType = ActivityCancellationType.TRY_CANCEL

    def task_queue(self, queue: str | None) -> str:
        """The queue to schedule on: the node's (``queue``, required) for a node activity,
        else the fixed control or pool queue (``queue`` must be None)."""
        if (self.queue == QueueKind.NODE) != (queue is not None):
            raise TypeError(f"{self.name} runs on a {self.queue} queue: pass queue= exactly for node activities")
        return queue or {QueueKind.CONTROL: CONTROL_QUEUE, QueueKind.POOL: POOL_QUEUE,
                          QueueKind.ROLLOUT_POOL: ROLLOUT_POOL_QUEUE}[self.queue]

    def with_timeouts(self, *, heartbeat: timedelta, schedule_to_start: timedelta) -> ActivityStub[In, Out]:
        """This stub with timeouts a run's config sets (the liveness watch's)."""
        return replace(self, heartbeat=heartbeat, schedule_to_start=schedule_to_start)

    def start(self, arg: In, *, summary: str, queue: str | None = None) -> workflow.ActivityHandle[Out]:
        """Schedule the activity; its handle is awaited (or cancelled) by the caller."""
        return workflow.start_activity(
            self.name,
            arg,
            result_type=self.output,
            task_queue=self.task_queue(queue),
            start_to_close_timeout=self.start_to_close,
            heartbeat_timeout=self.heartbeat,
            schedule_to_start_timeout=self.schedule_to_start,
            retry_policy=self.retry,
            cancellation_type=self.cancellation,
            summary=summary,
        )

    async def run(self, arg: In, *, summary: str, queue: str | None = None) -> Out:
        """Execute the activity; a node nobody polls (or that stops heartbeating) becomes ``NodeLost``."""
        try:
            return await self.start(arg, summary=summary, queue=queue)
        except ActivityError as err:
            cause = err.cause
            if isinstance(cause, TimeoutError) and cause.type in (TimeoutType.SCHEDULE_TO_START, TimeoutType.HEARTBEAT):
                task_queue = self.task_queue(queue)
                raise failure(
                    Failure.NODE_LOST, f"node queue {task_queue} did not run {self.name}: {cause.type.name}", task_queue
                ) from err
            raise


def _retry(max_attempts: int, max_interval_s: float = 30.0) -> RetryPolicy:
    return RetryPolicy(
        initial_interval=timedelta(seconds=1),
        backoff_coefficient=2.0,
        maximum_interval=timedelta(seconds=max_interval_s),
        maximum_attempts=max_attempts,
        non_retryable_error_types=sorted(f.value for f in NON_RETRYABLE),
    )


NODE_SCHEDULE_TO_START = timedelta(seconds=15)
HEARTBEAT = timedelta(seconds=15)
WATCH_LIFETIME = timedelta(days=7)  # a liveness watch that outlives this (a long pause) is started again


def on_node(name: str, inp: type[In], out: type[Out], start_to_close: timedelta,
            retry: RetryPolicy) -> ActivityStub[In, Out]:
    """A stub of the run's node queue: it heartbeats, and waits at most ``NODE_SCHEDULE_TO_START``
    for the node to pick it up (then the node is lost)."""
    return ActivityStub(name=name, input=inp, output=out, queue=QueueKind.NODE, start_to_close=start_to_close,
                        heartbeat=HEARTBEAT, schedule_to_start=NODE_SCHEDULE_TO_START, retry=retry)


# ---- placement ---------------------------------------------------------------------------
# maximum_attempts 0 = unlimited: a run with no free node waits for one (backoff capped at 30 s);
# short: a claim only reads the run's fence; one sent to a stopped agent's poll is retried elsewhere soon
CLAIM_NODE = ActivityStub(
    name="claim_node", input=placement.ClaimNodeInput, output=placement.NodeClaim, queue=QueueKind.POOL,
    start_to_close=timedelta(seconds=10), retry=_retry(0),
)
# the same activity, claimed from the pool of agents that may serve a run's rollouts (engines.nodes)
# (retried every 5 s at most: the agents of the run's own nodes poll this pool too and refuse it)
CLAIM_ROLLOUT_NODE = replace(CLAIM_NODE, queue=QueueKind.ROLLOUT_POOL, retry=_retry(0, 5.0))
# the run's rollout nodes changed at a step boundary: the fence moves to the new placement's epoch
FENCE_PLACEMENT: ActivityStub[placement.FencePlacementInput, None] = ActivityStub(
    name="fence_placement", input=placement.FencePlacementInput, output=None, queue=QueueKind.CONTROL,
    start_to_close=timedelta(seconds=30), retry=_retry(10),
)
PREPARE_DATA = ActivityStub(
    name="prepare_data", input=placement.PrepareDataInput, output=placement.DatasetInfo, queue=QueueKind.CONTROL,
    start_to_close=timedelta(minutes=5), retry=_retry(5),
)
INIT_POLICY = on_node("init_policy", placement.InitPolicyInput, placement.PolicyInfo, timedelta(minutes=30), _retry(5))
# heartbeats until cancelled (workflows/node_watch.py); its heartbeat and schedule-to-start timeouts are
# the run's node.liveness_timeout_s (``with_timeouts``); a cancel completes when the node acknowledges it
NODE_LIVENESS: ActivityStub[placement.NodeLivenessInput, None] = ActivityStub(
    name="node_liveness", input=placement.NodeLivenessInput, output=None, queue=QueueKind.NODE,
    start_to_close=WATCH_LIFETIME, retry=RetryPolicy(maximum_attempts=1),
    cancellation=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
)

# ---- the step ----------------------------------------------------------------------------
# rollout waits in retries while no engine is alive (engines come back at the next update)
ROLLOUT = on_node("rollout", sampling.RolloutInput, sampling.RolloutResult, timedelta(minutes=20), _retry(20, 10.0))
# the rewards of a rollout, scored by the node that generated (and holds) its samples
COMPUTE_REWARDS_ON_NODE = on_node(
    "compute_rewards_on_node", sampling.RewardInput, sampling.RewardResult, timedelta(minutes=10), _retry(5),
)
TRAIN_STEP = on_node("train_step", training.TrainStepInput, training.TrainStepResult, timedelta(minutes=30), _retry(5))
UPDATE_WEIGHTS = on_node(
    "update_weights", training.UpdateWeightsInput, training.UpdateWeightsResult, timedelta(minutes=10), _retry(10),
)
# engines.weight_sync distributed with rollout nodes: the trainer node's agent hosts the push's group
# store (short: it only binds a port), then its trainer broadcasts as rank 0 (an outcome, never retried:
# a group that failed is over, and the rollout nodes it did not reach pull the version by themselves)
OPEN_WEIGHT_GROUP = on_node(
    "open_weight_group", weight_group.OpenWeightGroupInput, weight_group.WeightGroupAddress, timedelta(seconds=30),
    _retry(3),
)
BROADCAST_WEIGHTS = on_node(
    "broadcast_weights", weight_group.BroadcastWeightsInput, weight_group.BroadcastWeightsResult,
    timedelta(minutes=10), RetryPolicy(maximum_attempts=1),
)
CHECKPOINT = on_node(
    "checkpoint", training.CheckpointInput, training.CheckpointResult, timedelta(minutes=60), _retry(10),
)
# a failed cell restart is an outcome, not an error (the run backs off): retries are for the trainer process
RESTART_CELLS = on_node(
    "restart_cells", cells.RestartCellsInput, cells.RestartCellsResult, timedelta(minutes=5), _retry(3),
)
# a failed eval costs the step its eval numbers, not the run (the step records an event)
EVALUATE = on_node("evaluate", training.EvalInput, training.EvalResult, timedelta(minutes=20), _retry(5, 10.0))

STUBS: tuple[ActivityStub, ...] = (
    CLAIM_NODE, FENCE_PLACEMENT, PREPARE_DATA, INIT_POLICY, NODE_LIVENESS, ROLLOUT, COMPUTE_REWARDS_ON_NODE, TRAIN_STEP,
    UPDATE_WEIGHTS, OPEN_WEIGHT_GROUP, BROADCAST_WEIGHTS, CHECKPOINT, RESTART_CELLS, EVALUATE,
)
