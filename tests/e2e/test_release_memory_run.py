"""``engines.release_memory: on`` in a real run (Temporal, node agent, trainer and engine
subprocesses, on the CPU): during step 2's train_step the engines are released (their
probes say so, generation is refused) and one of them is SIGKILLed; update_weights
resumes the survivor and restarts the dead slot on the new version; the trainer parks its
optimizer state on the host between steps. The run ends with weights bitwise equal to
the same run with release_memory off (its fault-free twin)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from gpu_runtime.engine.client import EngineClient, EngineError
from spec.events import EngineDead, EngineRecovered
from tests.e2e.faults import (
    Baselines, assert_bitwise_equal, final_weights, module_stack_fixtures, progress, start_run, wait_activity_started,
)
from tests.stack import Stack, async_wait_for, tiny_config
from workers.common import connect
from workflows.stubs import TRAIN_STEP

pytestmark = pytest.mark.e2e
STEPS = 3
# train_step sleeps this long before training: the engines are released meanwhile
ENV = {"MILESTONE_FAULT_TRAIN_DELAY_S": "4"}


def _config(store: Path, release: str) -> dict:
    return tiny_config(store, steps=STEPS, engines={**tiny_config(store)["engines"], "release_memory": release})


stack, store = module_stack_fixtures("release-memory", ENV)


@pytest.fixture(scope="module")
def baseline(baselines: Baselines, store: Path) -> dict:
    return baselines.weights(_config(store, "off"))


def _released(url: str) -> bool:
    c = EngineClient(url, timeout_s=5)
    try:
        return c.server_info()["memory_occupation"]["released"] == ["kv_cache", "weights"]
    except EngineError:
        return False
    finally:
        c.close()


def test_released_engines_killed_mid_train_step_heal_and_the_run_is_bitwise(stack: Stack, store: Path, baseline) -> None:
    run_id = "release-on"

    async def main() -> tuple:
        client = await connect(stack.server.address)
        handle = await start_run(client, run_id, _config(store, "on"))
        await wait_activity_started(client, f"{run_id}/step-2", TRAIN_STEP.name)
        urls = [e.url for e in (await progress(client, run_id)).engines]
        assert len(urls) == 2
        await async_wait_for(lambda: asyncio.to_thread(lambda: all(_released(u) for u in urls)), 60,
                             what="both engines released during train_step")
        with EngineClient(urls[0], timeout_s=30) as c:
            with pytest.raises(EngineError) as refused:
                c.generate([[1, 5, 6]], {"max_new_tokens": 2})
            assert refused.value.status == 503 and "memory is released" in str(refused.value)
        victim = stack.node_pids("node0")["engines"][0]
        os.kill(victim, signal.SIGKILL)
        summary = await asyncio.wait_for(handle.result(), 300)
        return summary, await progress(client, run_id), victim

    summary, prog, victim = asyncio.run(main())
    assert summary.steps == STEPS and summary.policy_version == STEPS
    assert_bitwise_equal(final_weights(store, run_id, STEPS), baseline)
    assert any(isinstance(e, EngineDead) and e.pid == victim for e in prog.events), prog.events
    assert any(isinstance(e, EngineRecovered) and e.version == "2" for e in prog.events), prog.events
    assert [(e.state, e.weight_version) for e in prog.engines] == [("healthy", STEPS)] * 2
    assert prog.engines[0].pid != victim and prog.engines[0].restart_count == 1
    logs = "".join(p.read_text(errors="replace") for p in stack.workdir.rglob("*.log"))
    assert "memory between phases: on (engines.release_memory is on)" in logs
    assert logs.count("optimizer state offloaded") >= STEPS  # the trainer parked it after every step
