"""A full disk is a wait, not a failure: what counts as one (``gpu_runtime.proc.disk``), how
the node agent reports it (``activities.disk``), and how the workflows wait for space and
call again (``workflows.disk_wait``) on Temporal's time-skipping test server."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.disk import disk_full_failure
from gpu_runtime.proc import disk
from gpu_runtime.proc.disk import DiskFull, guarded, is_no_space
from gpu_runtime.proc.rpc import RemoteError
from spec import events
from spec.events import RunEvent
from tests.unit.workflow_harness import Cluster, finish, progress, run_config, scenario, start_run
from workflows.disk_wait import FIRST_WAIT_S, MAX_WAIT_S, next_wait
from workflows.failures import Failure, failure
from workflows.stubs import CHECKPOINT, INIT_POLICY, ROLLOUT, TRAIN_STEP


class SafetensorError(Exception):  # the name safetensors' Rust error carries (safetensors._safetensors_rust)
    pass


def test_what_counts_as_a_full_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_no_space(OSError(errno.ENOSPC, "No space left on device"))
    assert is_no_space(OSError(errno.EDQUOT, "Disk quota exceeded"))
    # safetensors' message on a full tmpfs, as measured
    assert is_no_space(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert not is_no_space(OSError(errno.EACCES, "Permission denied"))
    assert not is_no_space(SafetensorError("Error while deserializing header: HeaderTooLarge"))
    assert not is_no_space(ValueError("No space left on device"))  # not a write error
    # torch's stream writer says only "unexpected pos": a full disk when a writer's path has almost no room
    torch_err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert not is_no_space(torch_err, [tmp_path])
    monkeypatch.setattr(disk, "free_bytes", lambda p: 4096)
    assert is_no_space(torch_err, [tmp_path])


def test_guarded_raises_disk_full_naming_paths_and_free_bytes(tmp_path: Path) -> None:
    def write(_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ckpt" / "policy.safetensors"))

    with pytest.raises(DiskFull) as got:
        guarded(write, lambda: [tmp_path])(None)
    message = str(got.value)
    assert str(tmp_path / "ckpt" / "policy.safetensors") in message  # the failed file, though it does not exist
    assert "bytes free" in message and "unknown" not in message
    assert isinstance(got.value.__cause__, OSError)

    def other(_: object) -> None:
        raise ValueError("bad field")

    with pytest.raises(ValueError):  # any other error passes as it came
        guarded(other, lambda: [tmp_path])(None)
    assert guarded(lambda a: a, lambda: [tmp_path])(3) == 3


def test_the_agent_reports_disk_full_and_fails_the_call_as_final() -> None:
    reported: list[tuple[str, RunEvent]] = []
    err = RemoteError("DiskFull", "no space left on device (OSError: ...): /w has 0 bytes free")
    got = disk_full_failure(err, "node0", "run-1", "checkpoint 3", lambda r, e: reported.append((r, e)))
    assert got is not None and got.type == Failure.DISK_FULL.value and got.non_retryable
    assert "checkpoint 3" in got.message and "/w has 0 bytes free" in got.message
    [(run_id, event)] = reported
    assert run_id == "run-1" and isinstance(event, events.DiskFull)
    assert (event.node, event.what, event.error, event.step) == ("node0", "checkpoint 3", err.message, None)
    assert disk_full_failure(RemoteError("ValueError", "x"), "node0", "run-1", "checkpoint 3", None) is None


def test_waits_grow_to_five_minutes() -> None:
    waits = [FIRST_WAIT_S]
    while waits[-1] < MAX_WAIT_S:
        waits.append(next_wait(waits[-1]))
    assert waits == [5, 10, 20, 40, 80, 160, 300] and next_wait(MAX_WAIT_S) == MAX_WAIT_S


def failing(n: int, kind: Failure = Failure.DISK_FULL):  # noqa: ANN201 (a Cluster hook)
    """A hook whose first ``n`` calls fail with ``kind`` (by default as a trainer on a full disk)."""
    left = {"n": n}

    async def hook(queue: str, attempt: int) -> None:
        if left["n"] > 0:
            left["n"] -= 1
            raise failure(kind, "checkpoint: no space left on device: /w has 0 bytes free")

    return hook


def test_a_full_disk_at_checkpoint_and_train_waits_then_the_run_completes() -> None:
    """A checkpoint that fails three times for lack of space and a train step that fails once:
    each is called again by the workflow after a wait (5, 10, 20 s; Temporal's retries are not
    spent: every call is a first attempt), nothing else of the step runs again, and the run
    completes with every step committed once."""
    cluster = Cluster()
    cluster.hook(CHECKPOINT, 2, failing(3))
    cluster.hook(TRAIN_STEP, 3, failing(1))
    cluster.hook(INIT_POLICY, None, failing(1))

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        # no liveness watch: the test server does not skip time while an activity runs
        handle = await start_run(env, run_config(steps=3, node={"liveness_timeout_s": 0}))
        summary = await finish(handle)
        assert (summary.steps, summary.policy_version) == (3, 3)
        assert [c.attempt for c in cluster.served(CHECKPOINT, 2)] == [1, 1, 1, 1]
        assert [c.attempt for c in cluster.served(TRAIN_STEP, 3)] == [1, 1]
        assert len(cluster.served(INIT_POLICY)) == 2
        assert len(cluster.served(ROLLOUT, 2)) == 1 and len(cluster.served(ROLLOUT, 3)) == 1
        p = await progress(handle)
        assert p.state == "completed" and [s.step for s in p.steps] == [1, 2, 3]
        assert [s.checkpointed for s in p.steps] == [False, True, True]
        assert await timers(handle) == [FIRST_WAIT_S]  # the run's own wait (init_policy's)
        assert await timers(env.client.get_workflow_handle(f"{handle.id}/step-2")) == [5, 10, 20]
        assert await timers(env.client.get_workflow_handle(f"{handle.id}/step-3")) == [5]

    scenario(cluster, body)


async def timers(handle: WorkflowHandle) -> list[float]:
    """The seconds of each timer the workflow started."""
    history = await handle.fetch_history()
    return [e.timer_started_event_attributes.start_to_fire_timeout.ToSeconds() for e in history.events
            if e.HasField("timer_started_event_attributes")]


def test_another_final_failure_is_not_waited_on() -> None:
    cluster = Cluster()
    cluster.hook(CHECKPOINT, 2, failing(1, Failure.INVALID_INPUT))

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        with pytest.raises(WorkflowFailureError):
            await finish(await start_run(env, run_config(steps=3)))
        assert len(cluster.served(CHECKPOINT, 2)) == 1

    scenario(cluster, body)
