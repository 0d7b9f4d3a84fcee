"""A full disk is a wait, not a failure: a trainer call that failed with ``DiskFull`` (a
write found no space: ``gpu_runtime.proc.disk``) is called again after a growing wait,
for as long as it takes. The node agent has already told the run what is full (a
``disk_full`` event: path and free bytes); freeing space is the operator's part.

The activity's own retries are not spent on it (``DiskFull`` is final for Temporal's
retry policy, which cannot give one error type unlimited attempts): the workflow sleeps
and calls again. Deterministic: the wait and the new call are commands only a
``DiskFull`` failure leads to, so histories recorded without one replay unchanged.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows.failures import Failure, failure_in

T = TypeVar("T")
FIRST_WAIT_S = 5.0
MAX_WAIT_S = 300.0


def next_wait(wait_s: float) -> float:
    """The wait after ``wait_s``: doubled, at most ``MAX_WAIT_S``."""
    return min(wait_s * 2, MAX_WAIT_S)


async def waiting_for_disk(call: Callable[[], Awaitable[T]], what: str) -> T:
    """``call()``; each time it fails with ``DiskFull``, a wait (5 s, doubling, at most 5 min)
    and ``call()`` again. Any other failure is raised as it came."""
    wait = FIRST_WAIT_S
    while True:
        try:
            return await call()
        except (ActivityError, ApplicationError) as err:
            kind, message = failure_in(err)
            if kind != Failure.DISK_FULL:
                raise
        workflow.logger.warning("%s: disk full (%s); trying again in %gs", what, message, wait)
        await workflow.sleep(wait)
        wait = next_wait(wait)
