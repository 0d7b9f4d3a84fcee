"""Dynamic sampling and the durable judge reward through whole (tiny) runs on one shared
stack: real Temporal server, workers, trainer, engine and router processes, and a real
judge HTTP server in this test process on 127.0.0.1. Rewards are scored on the node that
generated the samples, and dynamic sampling trains a selection of the rounds' chunks."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import reasoning_gym  # noqa: F401  (a dev dependency: imported, so a broken install fails loudly)
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from gpu_runtime.store import artifacts as art
from spec.run import RunConfig
from tests.recorded_histories import record
from tests.reward_servers import Behaviour, length_score, reward_server
from tests.stack import Stack, tiny_config
from workers.common import connect
from workflows.contracts.sampling import SamplingStats
from workflows.run_state import RunProgress, RunSummary, TrainingRunInput
from workflows.queues import CONTROL_QUEUE
from workflows.stubs import COMPUTE_REWARDS_ON_NODE, ROLLOUT, TRAIN_STEP
from workflows.training_run import RUN_WORKFLOWS, TrainingRun

pytestmark = pytest.mark.e2e
PPS, GROUP, PER_ROUND = 4, 4, 5


@pytest.fixture(scope="module")
def shared_stack(plain_stack: Stack) -> Stack:
    return plain_stack


async def run(client: Client, run_id: str, cfg: dict) -> tuple[RunSummary, RunProgress]:
    handle = await client.start_workflow(
        TrainingRun.run, TrainingRunInput(config=RunConfig.model_validate(cfg)), id=run_id, task_queue=CONTROL_QUEUE,
        result_type=RunSummary,
    )
    summary = await asyncio.wait_for(handle.result(), 300)
    return summary, await handle.query(TrainingRun.progress)


def stored(store: Path, key: str, cls: type) -> object:
    return cls.model_validate_json((store / key).read_text())


def scheduled(history: WorkflowHistory) -> list[str]:
    return [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
            if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]


def check_trained_selection(store: Path, step: int, d: SamplingStats) -> None:
    """The trainer trained exactly the selected groups of the step's rounds, read where they
    were generated (nothing copied): every group's rewards vary, unless the step fell back."""
    batch = json.loads((store / art.step_batch_key("e2e-dyn", step)).read_text())
    assert (batch["chunk_keys"], batch["rewards_key"]) == ([], "")
    rounds, chosen = batch["selection"]["rounds"], batch["selection"]["groups"]
    assert len(rounds) == d.rounds and len(chosen) == d.groups_trained
    assert not (store / art.step_prefix("e2e-dyn", step) / "batch").exists()  # nothing copied
    samples, rewards = [], []
    for r, g in chosen:
        round_samples = [x for k in rounds[r]["chunk_keys"] for x in stored(store, k, art.RolloutChunk).samples]
        round_rewards = stored(store, rounds[r]["rewards_key"], art.StepRewards).rewards
        samples += round_samples[g * GROUP : (g + 1) * GROUP]
        rewards += round_rewards[g * GROUP : (g + 1) * GROUP]
    assert [r.sample_id for r in rewards] == [x.sample_id for x in samples]
    groups = [rewards[i : i + GROUP] for i in range(0, len(rewards), GROUP)]
    assert all(len({r.reward for r in g}) > 1 for g in groups) or d.fallback
    assert all(len({x.prompt_index for x in samples[i : i + GROUP]}) == 1 for i in range(0, len(samples), GROUP))
    assert d.trained_reward_mean == pytest.approx(sum(r.reward for r in rewards) / len(rewards))


def test_dynamic_filter_trains_only_groups_whose_rewards_vary(shared_stack: Stack) -> None:
    store = shared_stack.workdir / "store"
    cfg = tiny_config(
        store, steps=2, checkpoint={"every": 2, "keep_last": 1}, eval={"enabled": False}, engines={"num_engines": 1},
        rollout={"prompts_per_step": PPS, "group_size": GROUP, "chunk_size": 8, "oversample": 1.25,
                 "dynamic_filter": {"enabled": True, "max_rounds": 3}},
        # which groups vary follows the data (odd answers), not the tiny model's float numerics, so
        # the rounds drawn are the same on every CPU (the math rule's depended on the machine's ISA)
        reward={"kind": "custom", "function": "tests.reward_fns:odd_answers_vary_reward"},
    )

    async def main() -> tuple[RunSummary, RunProgress]:
        client = await connect(shared_stack.server.address)
        summary, progress = await run(client, "e2e-dyn", cfg)
        replayer = Replayer(workflows=RUN_WORKFLOWS, data_converter=pydantic_data_converter)
        histories = [await client.get_workflow_handle(f"e2e-dyn/step-{step}").fetch_history() for step in (1, 2)]
        for history in histories:
            await replayer.replay_workflow(history)
        # step 2 drew two rounds (this seed's data), scored on the node; the trainer got the selection
        assert scheduled(histories[1])[:5] == [ROLLOUT.name, COMPUTE_REWARDS_ON_NODE.name] * 2 + [TRAIN_STEP.name]
        record("rl_step_dynamic", histories[1])  # tests/recorded_histories.py
        return summary, progress

    summary, progress = asyncio.run(main())
    assert (summary.steps, summary.policy_version) == (2, 2)
    cursor = 0
    for s in progress.steps:
        d = s.sampling
        assert d is not None, s
        print(f"step {s.step}: {d.rounds} rounds, {d.groups_generated} groups: {d.groups_kept} kept, filtered "
              f"{d.groups_filtered_all_correct} all correct / {d.groups_filtered_all_wrong} all wrong / "
              f"{d.groups_filtered_other} other; trained {d.groups_trained}")
        assert d.prompts_drawn == d.groups_generated == PER_ROUND * d.rounds and 1 <= d.rounds <= 3
        filtered = d.groups_filtered_all_correct + d.groups_filtered_all_wrong + d.groups_filtered_other
        assert d.groups_kept + filtered == d.groups_generated
        assert d.rounds == 3 or d.groups_kept >= PPS  # a round more only while too few groups varied
        assert d.groups_trained == (min(d.groups_kept, PPS) if d.groups_kept else PPS)
        assert d.fallback == (d.groups_kept == 0)
        cursor += d.prompts_drawn
        assert s.data_cursor == cursor  # every drawn prompt counts as used, filtered or not
        assert set(s.phase_seconds) >= {"rollout", "reward", "train"} and "assemble" not in s.phase_seconds

        check_trained_selection(store, s.step, d)
    totals = [sum(getattr(s.sampling, f) for s in progress.steps if s.sampling)
              for f in ("groups_kept", "groups_filtered_all_correct", "groups_filtered_all_wrong")]
    assert totals[0] > 0 and totals[1] + totals[2] > 0, totals  # this seed both keeps and filters groups ...
    assert max(s.sampling.rounds for s in progress.steps if s.sampling) > 1  # ... and needs a second round
    assert summary.data_cursor == cursor
    # the node agent exports the rewards' and dynamic sampling's metrics
    exported = shared_stack.scrape("node0")
    last = progress.steps[-1]
    assert exported['milestone_dynamic_sampling{metric="rounds"}'] == last.sampling.rounds
    assert exported["milestone_reward_std"] >= 0 and 'milestone_phase_seconds_count{phase="reward"}' in exported


def test_judge_reward_is_asked_once_per_sample_across_a_failed_attempt(shared_stack: Stack) -> None:
    """The judge answers 500 once after 5 judgements and the reward allows no in-process
    retry, so the reward activity's first attempt fails midway; Temporal retries it, and the
    retry asks only for the samples without a durable record."""
    store = shared_stack.workdir / "store"
    with reward_server(Behaviour(fail_once_after=5)) as judge:
        cfg = tiny_config(
            store, steps=1, sft={"steps": 20, "batch_size": 32, "lr": 3e-3}, checkpoint={"every": 1, "keep_last": 1},
            eval={"enabled": False}, engines={"num_engines": 1},
            reward={"kind": "weighted", "terms": [
                {"kind": "math_answer", "weight": 1.0},
                {"kind": "judge", "url": judge.url, "weight": 0.5, "concurrency": 2, "max_retries": 0}]},
        )

        async def main() -> tuple[RunSummary, WorkflowHistory]:
            client = await connect(shared_stack.server.address)
            summary, _ = await run(client, "e2e-judge", cfg)
            return summary, await client.get_workflow_handle("e2e-judge/step-1").fetch_history()

        summary, history = asyncio.run(main())
    assert summary.steps == 1
    attempts = [e.activity_task_started_event_attributes.attempt for e in history.events
                if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED]
    assert 2 in attempts  # the reward activity failed once and was retried (its attempt 2 started)
    assert scheduled(history)[:2] == [ROLLOUT.name, COMPUTE_REWARDS_ON_NODE.name]  # scored on the node
    record("rl_step_judge", history)  # a step scored on its node, its reward retried (tests/recorded_histories.py)

    chunk_keys = json.loads((store / art.step_batch_key("e2e-judge", 1)).read_text())["chunk_keys"]
    samples = [x for k in chunk_keys for x in stored(store, k, art.RolloutChunk).samples]
    assert len(samples) == 4 * GROUP
    assert judge.log.judged == {x.sample_id: 1 for x in samples}  # every sample judged exactly once
    assert judge.log.failed == 1 and judge.log.requests == len(samples) + 1

    rows = [json.loads(line) for line in (store / art.dataset_key("e2e-judge", "train")).read_text().splitlines()]
    rewards = stored(store, art.rewards_key("e2e-judge", 1), art.StepRewards).rewards
    for x, r in zip(samples, rewards, strict=True):  # the values of a fault-free run
        want = length_score({"response": x.response_text, "label": rows[x.prompt_index]["answer"]})
        assert r.terms["judge"] == pytest.approx(want)
        assert r.reward == pytest.approx(r.terms["math_answer"] + 0.5 * want)
    records = sorted((store / art.judge_prefix("e2e-judge", 1) / "judge").glob("*.json"))
    assert len(records) == len(samples)


def test_reasoning_gym_dataset_and_reward(shared_stack: Stack) -> None:
    """``data.kind: reasoning_gym`` (generated at data preparation into the run's store) and
    ``reward.kind: reasoning_gym`` (the generator's own scorer), also in the held-out eval."""
    store = shared_stack.workdir / "store"
    gym = {"kind": "reasoning_gym", "dataset": "chain_sum", "num_train": 200,
           "dataset_config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
    cfg = tiny_config(store, steps=2, data=gym, reward={"kind": "reasoning_gym"}, eval={"n": 8, "k": 2},
                      checkpoint={"every": 2, "keep_last": 1}, engines={"num_engines": 1})
    cfg["data"] = gym  # not merged with tiny_config's arithmetic fields

    async def main() -> tuple[RunSummary, RunProgress]:
        return await run(await connect(shared_stack.server.address), "e2e-gym", cfg)

    summary, progress = asyncio.run(main())
    assert summary.steps == 2 and summary.eval_greedy is not None and summary.eval_before_greedy is not None
    rows = [json.loads(line) for line in (store / art.dataset_key("e2e-gym", "train")).read_text().splitlines()]
    assert len(rows) == 200 and all(r["metadata"]["reasoning_gym"]["dataset"] == "chain_sum" for r in rows)
    rewards = stored(store, art.rewards_key("e2e-gym", 1), art.StepRewards).rewards
    assert rewards and all("reasoning_gym answer=" in r.detail for r in rewards)
    assert all(0.0 <= s.reward_mean <= 1.0 and 0.0 <= s.accuracy <= s.reward_mean + 1e-9 for s in progress.steps)
    print(f"reasoning_gym chain_sum: reward per step {[round(s.reward_mean, 3) for s in progress.steps]}, "
          f"held-out greedy {summary.eval_before_greedy:.3f} -> {summary.eval_greedy:.3f}")
