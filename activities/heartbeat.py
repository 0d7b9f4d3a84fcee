"""Run a blocking call while a background thread heartbeats the activity."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from temporalio import activity

T = TypeVar("T")


def with_heartbeat(fn: Callable[[], T], *, every_s: float | None = None, detail: Callable[[], Any] | None = None) -> T:
    """Call ``fn()`` in this thread; heartbeat from another until it returns: every ``every_s``,
    by default every 5 s or a quarter of the activity's heartbeat timeout when that is shorter
    (a rollout node's work carries the run's liveness timeout, a few seconds)."""
    stop = threading.Event()
    if every_s is None:
        timeout = activity.info().heartbeat_timeout
        every_s = min(5.0, timeout.total_seconds() / 4) if timeout else 5.0

    def beat() -> None:
        while not stop.wait(every_s):
            try:
                activity.heartbeat(detail() if detail else None)
            except Exception:  # the activity may be finishing; never break the work
                return

    # the activity context lives in context variables: run the beater inside a copy
    t = threading.Thread(target=contextvars.copy_context().run, args=(beat,), daemon=True)
    t.start()
    try:
        return fn()
    finally:
        stop.set()
        t.join(timeout=1.0)
