"""Run a blocking call while a background thread heartbeats the activity."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from temporalio import activity

T = TypeVar("T")


def with_heartbeat(fn: Callable[[], T], *, every_s: float = 5.0, detail: Callable[[], Any] | None = None) -> T:
    """Call ``fn()`` in this thread; heartbeat from another until it returns."""
    stop = threading.Event()

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
