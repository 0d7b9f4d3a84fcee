"""Long blocking calls inside activities keep heartbeating from a helper thread."""

from __future__ import annotations

import threading

from temporalio import activity
from temporalio.testing import ActivityEnvironment

from activities.heartbeat import with_heartbeat


def test_with_heartbeat_reaches_the_activity_context() -> None:
    beats: list[tuple] = []
    got_two = threading.Event()

    def on_heartbeat(*details: object) -> None:
        beats.append(details)
        if len(beats) >= 2:
            got_two.set()

    env = ActivityEnvironment()
    env.on_heartbeat = on_heartbeat

    @activity.defn
    def long_call() -> bool:
        # the "work" blocks until the beater thread has heartbeated twice
        return with_heartbeat(lambda: got_two.wait(timeout=30), every_s=0.05)

    assert env.run(long_call) is True
    assert len(beats) >= 2
