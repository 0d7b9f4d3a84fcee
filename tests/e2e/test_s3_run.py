"""A run whose store is a real S3 server (SeaweedFS): checkpoints survive the loss of
the node's local disk — a crashed trainer restores from S3 and replays."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from pathlib import Path

import pytest

from gpu_runtime.store import artifacts as art
from gpu_runtime.store.checkpoint_store import CheckpointStore
from infra.seaweedfs import SeaweedServer
from tests.e2e.faults import progress, start_run, wait_activity_started
from tests.s3_fixtures import new_bucket_name, seaweed, store_for  # noqa: F401  (fixture)
from tests.stack import Stack, tiny_config
from workers.common import connect

pytestmark = pytest.mark.e2e


def test_run_on_s3_survives_trainer_crash_and_local_disk_loss(seaweed: SeaweedServer, tmp_path: Path) -> None:  # noqa: F811
    bucket = new_bucket_name()
    env = {
        "MILESTONE_S3_ENDPOINT": seaweed.endpoint_url,
        "AWS_ACCESS_KEY_ID": seaweed.access_key,
        "AWS_SECRET_ACCESS_KEY": seaweed.secret_key,
        "MILESTONE_FAULT_TRAIN_DELAY_S": "2",
    }
    stack = Stack(tmp_path, env=env)
    cfg = tiny_config(tmp_path, steps=3, store=f"s3://{bucket}/exp", checkpoint={"every": 1, "keep_last": 2})
    try:
        stack.start()

        async def main() -> None:
            client = await connect(stack.server.address)
            handle = await start_run(client, "s3-run", cfg)
            await wait_activity_started(client, "s3-run/step-2", "train_step")
            # the node loses its disk copy of every checkpoint, then its trainer
            shutil.rmtree(tmp_path / "nodes" / "node0" / "trainer" / "s3-run" / "checkpoints", ignore_errors=True)
            os.kill(stack.node_pids("node0")["trainer"], signal.SIGKILL)
            summary = await asyncio.wait_for(handle.result(), 300)
            assert summary.steps == 3
            p = await progress(client, "s3-run")
            # checkpoint 1 uploads in the background: if it was not durable yet, step 0 + replay
            restored = p.steps[1].restored_from_step
            assert restored in (0, 1)
            assert p.steps[1].replayed_steps == list(range(restored + 1, 2))

        asyncio.run(main())
    finally:
        stack.stop()

    s3 = store_for(seaweed, bucket, "exp")
    ckpts = CheckpointStore(s3, art.checkpoints_prefix("s3-run"), local_dir=tmp_path / "verify")
    assert [c.step for c in ckpts.list_durable()] == [2, 3]  # keep_last: 2
    restored = ckpts.restore(tmp_path / "restored")
    assert restored.step == 3 and restored.meta["data_cursor"] == 12
