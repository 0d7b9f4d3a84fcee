"""Agent episodes in a real run (docs/agents.md): a multi-turn GRPO run on the tiny HF model
calls the calculator, and an engine SIGKILLed or the node agent restarted mid-episode each
end bitwise equal to the fault-free run, with no tool call executed twice.

The episodes call the tool for a legitimate reason: the run's SFT warm-up trains on the
task's demonstration episodes (``tool_arithmetic`` rows carry one, ``metadata.sft_target``),
as a real tool-use recipe does, so the tiny model writes ``<calculator>..</calculator>``
before RL. The test asserts that tools really ran (not only that nothing broke)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from tests.e2e.faults import (
    assert_bitwise_equal, baseline_weights, final_weights, module_stack_fixtures, progress, rollout_samples,
    run_progress, start_run,
)
from tests.stack import Stack, tiny_config, wait_for
from workers.common import connect
from workflows.run_state import RunProgress

pytestmark = pytest.mark.e2e
STEPS = 3
AGENT = {"tools": ["calculator"], "max_turns": 3, "max_tokens_per_turn": 12, "max_episode_tokens": 40}
# slowed decoding (fault-injection aid): a turn of ~10 tokens takes ~1 s, so a kill lands mid-episode
ENV = {"MILESTONE_ENGINE_STEP_DELAY_MS": "100"}


def agent_config(store: Path) -> dict:
    return tiny_config(
        store, steps=STEPS,
        data={"kind": "tool_arithmetic", "num_train": 200, "min_operand": 2, "max_operand": 9, "ops": "*"},
        sft={"steps": 100, "batch_size": 32, "lr": 3e-3},
        rollout={"prompts_per_step": 4, "group_size": 4, "chunk_size": 8, "agent": AGENT},
        eval={"enabled": False},
        checkpoint={"every": 3, "keep_last": 2},
    )


stack, store = module_stack_fixtures("agent", ENV)


@pytest.fixture(scope="module")
def baseline(stack: Stack, store: Path) -> dict:
    return baseline_weights(stack, store, agent_config(store), run_id="agent-base")


def episode_dirs(store: Path, run_id: str, step: int) -> list[Path]:
    return sorted((store / "runs" / run_id / "steps" / f"{step:06d}" / "rollout" / "episodes").glob("chunk-*/ep-*"))


def tool_executions(store: Path, run_id: str, dead_pids: frozenset[int] = frozenset()) -> tuple[int, int]:
    """Check the tool execution log (written just before each tool runs, one entry per call of a
    turn) against the recorded turns: every recorded execution is logged, and no tool ran again for
    a call once its result was recorded. The only other entries allowed are executions a crash cut
    off before their result was recorded: earlier than the recorded one, by a process in
    ``dead_pids`` (the killed node agent; docs/agents.md, durability). Returns (recorded
    executions, cut-off ones)."""
    recorded = lost = 0
    for step in range(1, STEPS + 1):
        for ep in episode_dirs(store, run_id, step):
            log: dict[tuple[str, str], list[dict]] = {}
            for p in (ep / "calls").glob("turn-*.json"):
                _, turn, index, _ = p.name.split("-", 3)
                log.setdefault((turn, index), []).append(json.loads(p.read_text()))
            turns = [json.loads(p.read_text()) for p in ep.glob("turn-*.json")]
            calls = {(f"{r['turn']:02d}", f"{c['index']:02d}"): c for r in turns for c in r["calls"]}
            for key, entries in log.items():
                c = calls.get(key)
                assert c is not None and c["executed"], f"{ep} call {key}: executed but never recorded: {entries}"
                kept = [e for e in entries if e["execution"] == c["execution"]]
                assert len(kept) == 1, f"{ep} call {key}: record holds {c['execution']}, log {entries}"
                for e in entries:
                    if e is not kept[0]:
                        assert e["pid"] in dead_pids and e["at"] < kept[0]["at"], (
                            f"{ep} call {key}: a tool ran again for a call: {entries}")
                recorded += 1
                lost += len(entries) - 1
            assert {k for k, c in calls.items() if c["executed"]} == set(log), f"{ep}: recorded {calls}, log {log}"
    return recorded, lost


def test_multi_turn_run_calls_the_tool(stack: Stack, store: Path, baseline: dict) -> None:
    p = run_progress(stack, "agent-base")
    assert [s.step for s in p.steps] == [1, 2, 3]
    metrics = [s.agent for s in p.steps]
    assert all(m is not None for m in metrics), metrics
    assert sum(m["tool_calls"] for m in metrics) > 0, metrics  # the model really called the calculator
    assert all(m["turns_mean"] >= 1 and m["episodes"] == 16 for m in metrics)
    assert tool_executions(store, "agent-base") == (sum(m["tool_calls"] for m in metrics), 0)
    for step in range(1, STEPS + 1):
        for s in rollout_samples(store, "agent-base", step):
            ep = s["episode"]
            assert ep["outcome"] in ("completed", "truncated", "tool_error", "timeout")
            assert len(s["loss_mask"]) == len(s["response_ids"]) == len(s["logprobs"])
            # tool turns (loss mask 0) exist exactly when a tool answered and the episode went on
            assert (0 in s["loss_mask"]) == (ep["turns"] > 1), ep
    # RL trained on the episodes: some group's rewards varied, so the weights moved after SFT (v0)
    assert any(s.reward_std > 0 for s in p.steps), [(s.reward_mean, s.reward_std) for s in p.steps]
    v0 = final_weights(store, "agent-base", 0)
    assert any(not torch.equal(v0[k], baseline[k]) for k in v0)


def _kill_mid_episode(stack: Stack, store: Path, run_id: str, fault: str) -> tuple[RunProgress, int]:
    """Start the run; once a turn of step 2 is recorded but its rollout is unfinished, inject
    ``fault``; the run's progress and the killed process's pid."""

    async def main() -> tuple[RunProgress, int]:
        client = await connect(stack.server.address)
        handle = await start_run(client, run_id, agent_config(store))
        step2 = store / "runs" / run_id / "steps" / "000002" / "rollout"
        wait_for(lambda: any(step2.glob("episodes/chunk-*/ep-*/turn-00.json")), 300, interval_s=0.05,
                 what="step 2's first finished turn")
        assert not list(step2.glob("chunk-*.json")) or len(list(step2.glob("chunk-*.json"))) < 2
        if fault == "engine":
            killed = stack.node_pids("node0")["engines"][0]
            os.kill(killed, signal.SIGKILL)
        else:
            killed = stack.procs["gpu-node0"].pid
            stack.kill("gpu-node0")
            stack.start_gpu("node0")
        await asyncio.wait_for(handle.result(), 600)
        return await progress(client, run_id), killed

    return asyncio.run(main())


@pytest.mark.parametrize("fault", ["engine", "worker"])
def test_fault_mid_episode_ends_bitwise_equal(stack: Stack, store: Path, baseline: dict, fault: str) -> None:
    run_id = f"agent-{fault}"
    p, killed = _kill_mid_episode(stack, store, run_id, fault)
    assert [s.step for s in p.steps] == [1, 2, 3]
    if fault == "engine":
        assert "engine_dead" in [e.kind for e in p.events]
    else:  # the rollout resumed on the restarted agent: finished turns were reused, not regenerated
        assert any(e.kind == "node_lost" for e in p.events), [e.kind for e in p.events]
        step2 = p.steps[1].agent
        assert step2 is not None and step2["turns_reused"] + step2["model_turns_reused"] > 0, step2
    # an engine's death loses no tool call (tools run in the node agent); a killed agent may have
    # been inside a tool call whose result it never recorded: that call is the only one run again
    _, lost = tool_executions(store, run_id, frozenset({killed}) if fault == "worker" else frozenset())
    assert lost <= 2, lost  # at most one call in flight per chunk (a chunk runs its tools one at a time)
    for step in range(1, STEPS + 1):  # the same episodes, token for token
        got, want = rollout_samples(store, run_id, step), rollout_samples(store, "agent-base", step)
        assert [(s["response_ids"], s["logprobs"], s["loss_mask"]) for s in got] == [
            (s["response_ids"], s["logprobs"], s["loss_mask"]) for s in want], f"step {step}"
    assert_bitwise_equal(final_weights(store, run_id, STEPS), baseline)
