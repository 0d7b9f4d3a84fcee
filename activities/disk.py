"""A trainer write that failed for lack of space (``gpu_runtime.proc.disk.DiskFull``), as the
run sees it: a ``disk_full`` event now (a signal: the activity fails, its result carries
nothing) and the ``DiskFull`` failure, on which the workflow waits and calls again
(``workflows.disk_wait``) instead of spending the activity's retries."""

from __future__ import annotations

import logging
from collections.abc import Callable

from temporalio.exceptions import ApplicationError

from gpu_runtime.proc.disk import DiskFull
from gpu_runtime.proc.rpc import RemoteError
from spec.event_text import event_text
from spec.events import DiskFull as DiskFullEvent, RunEvent, utc_now
from workflows.failures import Failure, failure

log = logging.getLogger(__name__)


def disk_full_failure(
    err: Exception, node_id: str, run_id: str, what: str, report: Callable[[str, RunEvent], None] | None,
) -> ApplicationError | None:
    """``DiskFull`` reported to the run and as its failure; None when ``err`` is another error."""
    if not (isinstance(err, RemoteError) and err.error_type == DiskFull.__name__) and not isinstance(err, DiskFull):
        return None
    message = err.message if isinstance(err, RemoteError) else str(err)
    event = DiskFullEvent(at=utc_now(), node=node_id, what=what, error=message)
    log.warning("run %s: %s", run_id, event_text(event))
    if report is not None:
        report(run_id, event)
    return failure(Failure.DISK_FULL, f"{what} on node {node_id}: {message}")
