"""Executing an activity from a workflow with its timing policy (``workflows.policies``)."""

from __future__ import annotations

from typing import TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, TimeoutError, TimeoutType

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel

    from workflows.failures import Failure, failure
    from workflows.policies import TIMINGS

R = TypeVar("R", bound=BaseModel)


async def run_activity(name: str, arg: BaseModel, result_type: type[R], *, task_queue: str, summary: str) -> R:
    """Execute an activity with its timing policy; a node nobody polls becomes ``NodeLost``."""
    t = TIMINGS[name]
    try:
        return await workflow.execute_activity(
            name,
            arg,
            result_type=result_type,
            task_queue=task_queue,
            start_to_close_timeout=t.start_to_close,
            heartbeat_timeout=t.heartbeat,
            schedule_to_start_timeout=t.schedule_to_start,
            retry_policy=t.retry,
            summary=summary,
        )
    except ActivityError as err:
        cause = err.cause
        if isinstance(cause, TimeoutError) and cause.type in (TimeoutType.SCHEDULE_TO_START, TimeoutType.HEARTBEAT):
            raise failure(
                Failure.NODE_LOST, f"node queue {task_queue} did not run {name}: {cause.type.name}", task_queue
            ) from err
        raise
