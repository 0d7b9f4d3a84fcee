"""An agent written with the ``openai`` SDK (``examples/agents/react_calculator.py``) trained in a
real run (``rollout.agent.kind: openai``, docs/agents.md): its episodes run in child processes of
the node agent and call the endpoint the rollout serves; an agent process SIGKILLed mid-episode,
and separately an engine SIGKILLed mid-call, each end with weights bitwise equal to the fault-free
run, every prompt trained once, and no recorded call generated twice.

The tiny model learns the calculator task's call format in the SFT warm-up, as in
``test_agent_run.py``; its ChatML template has no tool section, so the endpoint reads its calls
with the ``tags`` parser and returns them to the agent as OpenAI ``tool_calls``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections import Counter
from pathlib import Path

import pytest

from tests.e2e.faults import (
    assert_bitwise_equal, baseline_weights, final_weights, module_stack_fixtures, progress, rollout_samples,
    run_progress, start_run,
)
from tests.stack import Stack, tiny_config, wait_for
from workers.common import connect
from workflows.run_state import RunProgress

pytestmark = pytest.mark.e2e
STEPS = 3
AGENT = {"kind": "openai", "entrypoint": "examples.agents.react_calculator:run", "max_calls": 3,
         "max_tokens_per_turn": 12, "max_episode_tokens": 40, "episode_timeout_s": 120}
# slowed decoding (fault-injection aid): a call of ~10 tokens takes ~1 s and an engine serves one call
# at a time, so a step's rollout keeps both engines busy for seconds and a kill lands mid-episode
ENV = {"MILESTONE_ENGINE_STEP_DELAY_MS": "100"}


def agent_config(store: Path) -> dict:
    return tiny_config(
        store, steps=STEPS,
        data={"kind": "tool_arithmetic", "num_train": 200, "min_operand": 2, "max_operand": 9, "ops": "*"},
        sft={"steps": 300, "batch_size": 32, "lr": 3e-3},
        rollout={"prompts_per_step": 2, "group_size": 4, "chunk_size": 4, "agent": AGENT},
        eval={"enabled": False},
        checkpoint={"every": 3, "keep_last": 2},
    )


stack, store = module_stack_fixtures("openai_agent", ENV)


@pytest.fixture(scope="module")
def baseline(stack: Stack, store: Path) -> dict:
    return baseline_weights(stack, store, agent_config(store), run_id="oa-base")


def episodes(store: Path, run_id: str, step: int) -> list[Path]:
    return sorted((store / "runs" / run_id / "steps" / f"{step:06d}" / "rollout" / "episodes").glob("chunk-*/ep-*"))


def generations(store: Path, run_id: str) -> Counter:
    """How often each recorded call was generated (the generation log is written just before the
    engines are asked), by (step, episode folder, call)."""
    seen: Counter = Counter()
    for step in range(1, STEPS + 1):
        for ep in episodes(store, run_id, step):
            for call in ep.glob("call-*.json"):
                n = len(list(ep.glob(f"gen/{call.stem}-*.json")))
                seen[(step, ep.parent.name, ep.name, call.stem)] = n
    return seen


def test_an_openai_sdk_agent_trains(stack: Stack, store: Path, baseline: dict) -> None:
    p = run_progress(stack, "oa-base")
    assert [s.step for s in p.steps] == [1, 2, 3]
    metrics = [s.agent for s in p.steps]
    assert all(m is not None and m["episodes"] == 8 for m in metrics), metrics
    assert sum(m["tool_calls"] for m in metrics) > 0, metrics  # the model called the agent's calculator
    assert all(m["calls_replayed"] == 0 and m["agent_restarts"] == 0 for m in metrics)
    assert set(generations(store, "oa-base").values()) == {1}
    for step in range(1, STEPS + 1):
        for s in rollout_samples(store, "oa-base", step):
            assert s["episode"]["outcome"] in ("completed", "no_calls", "agent_error", "timeout")
            assert len(s["loss_mask"]) == len(s["response_ids"]) == len(s["logprobs"])
            assert (0 in s["loss_mask"]) == (s["episode"]["turns"] > 1), s["episode"]
    assert any(s.reward_std > 0 for s in p.steps), [(s.reward_mean, s.reward_std) for s in p.steps]


def _kill_mid_episode(stack: Stack, store: Path, run_id: str, fault: str) -> tuple[RunProgress, int]:
    async def main() -> tuple[RunProgress, int]:
        client = await connect(stack.server.address)
        handle = await start_run(client, run_id, agent_config(store))
        root = store / "runs" / run_id / "steps" / "000002" / "rollout" / "episodes"
        if fault == "agent":
            def waiting(ep: Path) -> bool:
                """The agent got call 0's tool calls and has not had call 1's answer: alive, mid-episode
                (a record is written before its answer is returned)."""
                try:
                    first = json.loads((ep / "call-000.json").read_text())
                except (FileNotFoundError, json.JSONDecodeError):
                    return False
                return (first["response"]["choices"][0]["finish_reason"] == "tool_calls"
                        and not (ep / "call-001.json").exists() and (ep / "agent-00.json").exists())

            def kill_one() -> int | None:
                for ep in sorted(root.glob("chunk-*/ep-*")):
                    if waiting(ep):
                        pid = json.loads((ep / "agent-00.json").read_text())["pid"]
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:  # it ended between the two reads: another one
                            continue
                        return int(pid)
                return None

            killed = wait_for(kill_one, 300, interval_s=0.01, what="a step-2 agent past its first call, killed")
        else:  # an engine, once step 2's calls are being generated (the engines are busy from then on)
            wait_for(lambda: any(root.glob("chunk-*/ep-*/gen/*.json")), 300, interval_s=0.02,
                     what="step 2's first generation")
            killed = stack.node_pids("node0")["engines"][0]
            os.kill(killed, signal.SIGKILL)
        await asyncio.wait_for(handle.result(), 600)
        return await progress(client, run_id), killed

    return asyncio.run(main())


@pytest.mark.parametrize("fault", ["agent", "engine"])
def test_a_kill_mid_episode_ends_bitwise_equal(stack: Stack, store: Path, baseline: dict, fault: str) -> None:
    run_id = f"oa-{fault}"
    p, _ = _kill_mid_episode(stack, store, run_id, fault)
    assert [s.step for s in p.steps] == [1, 2, 3]
    step2 = p.steps[1].agent
    assert step2 is not None
    if fault == "agent":  # restarted in place; its recorded calls answered from the record
        assert step2["agent_restarts"] >= 1 and step2["calls_replayed"] >= 1, step2
    else:
        assert "engine_dead" in [e.kind for e in p.events]
    # every recorded call was generated exactly once, across the fault
    assert set(generations(store, run_id).values()) == {1}
    for step in range(1, STEPS + 1):  # the same episodes, token for token, each prompt once
        got, want = rollout_samples(store, run_id, step), rollout_samples(store, "oa-base", step)
        assert [s["sample_id"] for s in got] == [s["sample_id"] for s in want]
        assert [(s["response_ids"], s["logprobs"], s["loss_mask"]) for s in got] == [
            (s["response_ids"], s["logprobs"], s["loss_mask"]) for s in want], f"step {step}"
    assert_bitwise_equal(final_weights(store, run_id, STEPS), baseline)
