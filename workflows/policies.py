"""Timeouts and retry policies for activities, in one place.

Node-queue activities have a short schedule-to-start timeout: when a node agent
is gone nobody polls its queue, the timeout fires, and the workflow re-places the
work (Temporal does not move work between queues on its own).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from temporalio.common import RetryPolicy

from workflows.failures import NON_RETRYABLE

@dataclass(frozen=True)
class ActivityTiming:
    start_to_close: timedelta
    heartbeat: timedelta | None
    schedule_to_start: timedelta | None
    retry: RetryPolicy


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

TIMINGS: dict[str, ActivityTiming] = {
    # maximum_attempts 0 = unlimited: a run with no free node waits for one (backoff capped at 30 s)
    # short: a claim only reads the run's fence; one sent to a stopped agent's poll is retried elsewhere soon
    "claim_node": ActivityTiming(timedelta(seconds=10), None, None, _retry(0)),
    "prepare_data": ActivityTiming(timedelta(minutes=5), None, None, _retry(5)),
    "init_policy": ActivityTiming(timedelta(minutes=30), HEARTBEAT, NODE_SCHEDULE_TO_START, _retry(5)),
    # rollout waits in retries while no engine is alive (engines come back at the next update)
    "rollout": ActivityTiming(timedelta(minutes=20), HEARTBEAT, NODE_SCHEDULE_TO_START, _retry(20, 10.0)),
    "compute_rewards": ActivityTiming(timedelta(minutes=10), HEARTBEAT, None, _retry(5)),
    "assemble_batch": ActivityTiming(timedelta(minutes=5), None, None, _retry(5)),
    "train_step": ActivityTiming(timedelta(minutes=30), HEARTBEAT, NODE_SCHEDULE_TO_START, _retry(5)),
    "update_weights": ActivityTiming(timedelta(minutes=10), HEARTBEAT, NODE_SCHEDULE_TO_START, _retry(10)),
    "checkpoint": ActivityTiming(timedelta(minutes=10), HEARTBEAT, NODE_SCHEDULE_TO_START, _retry(10)),
    # a failed cell restart is an outcome, not an error (the run backs off): retries are for the trainer process
    "restart_cells": ActivityTiming(timedelta(minutes=5), HEARTBEAT, NODE_SCHEDULE_TO_START, _retry(3)),
    # a failed eval costs the step its eval numbers, not the run (RLStep records an event)
    "evaluate": ActivityTiming(timedelta(minutes=20), HEARTBEAT, NODE_SCHEDULE_TO_START, _retry(5, 10.0)),
}
