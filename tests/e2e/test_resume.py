"""``milestone start --resume-from``: continue after the newest durable checkpoint,
never from step 0; a resume with nothing to do says so and exits non-zero."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.e2e.faults import assert_bitwise_equal, final_weights, progress, run_to_end
from tests.stack import ROOT, Stack, tiny_config
from workers.common import connect

pytestmark = pytest.mark.e2e


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "milestone_cli.main", "--address", stack.server.address, *args],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_resume_continues_from_checkpoint(stack: Stack, tmp_path: Path) -> None:
    store = tmp_path / "store"
    short = write_config(tmp_path / "short.yaml", tiny_config(store, steps=2))
    longer = write_config(tmp_path / "long.yaml", tiny_config(store, steps=4))

    out = cli(stack, "start", str(short), "--run-id", "resumable", "--wait")
    assert out.returncode == 0, out.stderr

    # a run id names one run forever, even a completed one: refused by the store...
    out = cli(stack, "start", str(short), "--run-id", "resumable")
    assert out.returncode == 2 and "run id 'resumable' is taken" in out.stderr and "runs/resumable/" in out.stderr
    # ...and by Temporal when the config points at another store
    other = write_config(tmp_path / "other.yaml", tiny_config(tmp_path / "other-store", steps=2))
    out = cli(stack, "start", str(other), "--run-id", "resumable")
    assert out.returncode == 2 and "Temporal already has a workflow resumable" in out.stderr
    assert not (tmp_path / "other-store").exists()

    # nothing to resume: the checkpoint already covers steps: 2
    out = cli(stack, "start", str(short), "--resume-from", "resumable")
    assert out.returncode == 3
    assert "nothing to resume" in out.stderr and "step 2" in out.stderr

    out = cli(stack, "start", str(longer), "--resume-from", "resumable", "--wait")
    assert out.returncode == 0, out.stderr
    assert "resuming resumable at step 3" in out.stdout

    async def main() -> None:
        client = await connect(stack.server.address)
        p = await progress(client, "resumable")
        assert [s.step for s in p.steps] == [3, 4]  # steps 1-2 were not trained again
        assert p.policy_version == 4 and p.data_cursor == 4 * 4
        await run_to_end(client, "straight", tiny_config(store, steps=4))

    asyncio.run(main())
    assert_bitwise_equal(final_weights(store, "resumable", 4), final_weights(store, "straight", 4))


def test_resume_errors_are_clear(stack: Stack, tmp_path: Path) -> None:
    cfg = write_config(tmp_path / "c.yaml", tiny_config(tmp_path / "store", steps=2))
    out = cli(stack, "start", str(cfg), "--resume-from", "no-such-run")
    assert out.returncode == 2 and "no durable checkpoint" in out.stderr
    out = cli(stack, "start", str(cfg), "--resume-from", "s3:/bad")
    assert out.returncode == 2 and "--resume-from" in out.stderr
