"""NaN/inf in training is a non-retryable Divergence: the run pauses on its last good
checkpoint instead of failing or training on garbage (DESIGN §7)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gpu_runtime.store import artifacts as art
from gpu_runtime.store.checkpoint_store import CheckpointStore
from gpu_runtime.store.object_store import LocalStore
from spec.events import Divergence
from tests.e2e.faults import progress, start_run
from tests.stack import Stack, async_wait_for, tiny_config
from workers.common import connect

pytestmark = pytest.mark.e2e


def test_divergence_pauses_the_run(stack: Stack, tmp_path: Path) -> None:
    store = tmp_path / "store"
    # an absurd learning rate blows the weights up after the first update
    cfg = tiny_config(store, steps=4, train={"lr": 1e9, "grad_clip": 1e9})

    async def main() -> None:
        client = await connect(stack.server.address)
        handle = await start_run(client, "diverge", cfg)

        async def paused() -> bool:
            p = await progress(client, "diverge")
            return p.state == "paused"

        await async_wait_for(paused, 180, what="the run to pause")
        p = await progress(client, "diverge")
        events = [e for e in p.events if isinstance(e, Divergence)]
        assert events and "not finite" in events[0].message, events
        failed_step = p.step + 1
        # the committed state and its checkpoint are intact; the failed step left nothing behind
        ckpts = CheckpointStore(LocalStore(store), art.checkpoints_prefix("diverge"), local_dir=tmp_path / "v")
        assert ckpts.latest_durable() is not None and ckpts.latest_durable().step == p.step
        assert not (store / art.step_prefix("diverge", failed_step) / "train_result.json").exists()
        desc = await handle.describe()
        assert desc.status is not None and desc.status.name == "RUNNING"
        await handle.terminate("test done")

    asyncio.run(main())
