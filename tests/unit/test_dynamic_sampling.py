"""Dynamic sampling on stored artifacts: which groups vary, the trained batch the
``assemble_batch`` activity writes (real local store, Temporal's activity environment),
and the keys, seeds and sample ids of a rollout round."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.control import assemble_batch
from gpu_runtime.data.dynamic_sampling import assemble_groups, group_stats
from gpu_runtime.rollout.chunks import plan_chunks
from gpu_runtime.rollout.request import RolloutRequest
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.uri import open_store
from spec.rollout import RolloutSpec
from spec.trainer_rpc import SampledRound
from workflows.contracts.sampling import AssembleBatchInput, SamplingStats
from workflows.failures import Failure


def reward(sample_id: str, value: float, correct: bool | None = None) -> art.SampleReward:
    return art.SampleReward(sample_id=sample_id, reward=value, correct=value > 0 if correct is None else correct)


def sample(sample_id: str, prompt: int = 0, group: int = 0) -> art.Sample:
    return art.Sample(sample_id=sample_id, prompt_index=prompt, group_index=group, prompt_ids=[1], response_ids=[2],
                      logprobs=[0.0], weight_version=3, finish_reason="stop")


def test_group_stats() -> None:
    values = [(1, 1), (0, 0), (1, 0), (0.5, 0.5), (0.2, 0.7)]  # groups of two
    rewards = [reward(f"g{g}-{k}", v) for g, pair in enumerate(values) for k, v in enumerate(pair)]
    rewards[7] = rewards[7].model_copy(update={"correct": False})  # group 3: equal rewards, mixed correctness
    stats = group_stats(rewards, 2)
    assert (stats.groups, stats.varied, stats.all_correct, stats.all_wrong, stats.all_equal_other) == (5, [2, 4], 1, 1, 1)
    with pytest.raises(ValueError, match="7 rewards do not split into groups of 2"):
        group_stats(rewards[:7], 2)


def test_assemble_groups_in_the_given_order() -> None:
    r0 = [sample(f"s1-p{p}-g{g}", p, g) for p in range(3) for g in range(2)]
    r1 = [sample(f"s1-r1-p{p}-g{g}", p, g) for p in range(3, 5) for g in range(2)]
    rounds = [(r0, [reward(s.sample_id, 1.0) for s in r0]), (r1, [reward(s.sample_id, 0.0) for s in r1])]
    samples, rewards = assemble_groups(rounds, [(1, 1), (0, 2), (0, 0)], 2)
    assert [s.sample_id for s in samples] == ["s1-r1-p4-g0", "s1-r1-p4-g1", "s1-p2-g0", "s1-p2-g1", "s1-p0-g0", "s1-p0-g1"]
    assert [r.sample_id for r in rewards] == [s.sample_id for s in samples]
    with pytest.raises(ValueError, match="round 1 has 2 groups"):
        assemble_groups(rounds, [(1, 2)], 2)
    with pytest.raises(ValueError, match="no round 2"):
        assemble_groups(rounds, [(2, 0)], 2)
    crossed = [(r0, list(reversed(rounds[0][1])))]
    with pytest.raises(ValueError, match="reward of s1-p2-g1 stored against sample s1-p0-g0"):
        assemble_groups(crossed, [(0, 0)], 2)


def test_assemble_batch_writes_the_kept_groups(tmp_path: Path) -> None:
    uri = f"file://{tmp_path / 'store'}"
    store = open_store(uri)
    rounds = []
    for r in range(2):
        samples = [sample(f"s2-r{r}-p{p}-g{g}", p, g) for p in range(3) for g in range(2)]
        key = art.rollout_chunk_key("run", 2, 0, r)
        art.put_model(store, key, art.RolloutChunk(run_id="run", step=2, chunk=0, seed=1, weight_version=3,
                                                   samples=samples))
        rw_key = art.rewards_key("run", 2, r)
        art.put_model(store, rw_key, art.StepRewards(run_id="run", step=2, rewards=[
            reward(s.sample_id, float(r + k % 2)) for k, s in enumerate(samples)]))
        rounds.append(SampledRound(chunk_keys=[key], rewards_key=rw_key))
    stats = SamplingStats(rounds=2, prompts_drawn=6, groups_generated=6, groups_kept=6, groups_filtered_all_correct=0,
                          groups_filtered_all_wrong=0, groups_filtered_other=0, groups_trained=3, trained_reward_mean=0)
    inp = AssembleBatchInput(run_id="run", step=2, store_uri=uri, rounds=rounds, groups=[(0, 1), (1, 0), (1, 2)],
                             group_size=2, chunk_size=4, sampling=stats)
    out = ActivityEnvironment().run(assemble_batch, inp)
    assert out.chunk_keys == ["runs/run/steps/000002/batch/chunk-0000.json", "runs/run/steps/000002/batch/chunk-0001.json"]
    assert out.rewards_key == "runs/run/steps/000002/batch/rewards.json" and out.n_samples == 6
    chunks = [art.get_model(store, k, art.RolloutChunk) for k in out.chunk_keys]
    ids = [s.sample_id for c in chunks for s in c.samples]
    assert ids == ["s2-r0-p1-g0", "s2-r0-p1-g1", "s2-r1-p0-g0", "s2-r1-p0-g1", "s2-r1-p2-g0", "s2-r1-p2-g1"]
    assert [len(c.samples) for c in chunks] == [4, 2] and chunks[0].weight_version == 3
    stored = art.get_model(store, out.rewards_key, art.StepRewards).rewards
    assert [r.sample_id for r in stored] == ids and [r.reward for r in stored] == [0, 1, 1, 2, 1, 2]
    assert out.reward_mean == pytest.approx(7 / 6)
    # the same bytes on a retry
    before = [store.get_bytes(k) for k in [*out.chunk_keys, out.rewards_key]]
    again = ActivityEnvironment().run(assemble_batch, inp)
    assert again.model_dump(exclude={"seconds"}) == out.model_dump(exclude={"seconds"})
    assert [store.get_bytes(k) for k in [*out.chunk_keys, out.rewards_key]] == before
    with pytest.raises(ApplicationError) as err:
        ActivityEnvironment().run(assemble_batch, inp.model_copy(update={"groups": [(0, 5)]}))
    assert err.value.type == Failure.INVALID_INPUT and "round 0 has 3 groups" in err.value.message


def request(round_: int) -> RolloutRequest:
    rollout = RolloutSpec(prompts_per_step=3, group_size=2, chunk_size=4, max_new_tokens=4, temperature=1.0,
                          top_p=1.0, top_k=-1)
    return RolloutRequest(run_id="run", step=4, seed=9, policy_version=3, data_cursor=10, n_rows=50, rollout=rollout,
                          round=round_)


def test_a_round_has_its_own_seeds_and_keys() -> None:
    r0, r1 = plan_chunks(request(0)), plan_chunks(request(1))
    assert [p.members for p in r0] == [p.members for p in r1]  # the same cursor: the same prompts
    assert [p.seed for p in r0] == [art.derive_seed(9, 4, c) for c in range(2)]  # round 0 as before the rounds
    assert [p.seed for p in r1] == [art.derive_seed(9, 4, "round", 1, c) for c in range(2)]
    assert art.rollout_chunk_key("run", 4, 1, 0) == "runs/run/steps/000004/rollout/chunk-0001.json"
    assert art.rollout_chunk_key("run", 4, 1, 2) == "runs/run/steps/000004/rollout/round-02/chunk-0001.json"
    assert art.judge_prefix("run", 4, 2) == "runs/run/steps/000004/round-02/judge"


def test_the_progress_line_shows_the_filter_and_reward_errors() -> None:
    from milestone_cli.progress_view import format_progress
    from workflows.run_state import RunProgress
    from workflows.contracts.step import StepSummary

    stats = SamplingStats(rounds=2, prompts_drawn=12, groups_generated=12, groups_kept=5, groups_filtered_all_correct=4,
                          groups_filtered_all_wrong=3, groups_filtered_other=0, groups_trained=4, trained_reward_mean=0.5)
    step = StepSummary(step=1, policy_version=1, data_cursor=12, reward_mean=0.5, reward_std=0.1, accuracy=0.5, loss=0.1,
                       step_seconds=1.0, sampling=stats, reward_errors=2)
    line = format_progress(RunProgress(run_id="r", state="running", step=1, total_steps=3, policy_version=1,
                                       data_cursor=12, steps=[step]))
    assert line.endswith("| kept 5/12 groups in 2 rounds | 2 reward errors")


def test_assemble_batch_of_a_left_behind_placement_writes_nothing(tmp_path: Path) -> None:
    """``assemble_batch`` writes at the step's placement epoch: once the run has moved to a
    newer one, its batch write is refused (NodeLost, retried by the run's re-placement)."""
    from gpu_runtime.store.fence import raise_fence

    uri = f"file://{tmp_path / 'store'}"
    store = open_store(uri)
    samples = [sample(f"s2-p{p}-g{g}", p, g) for p in range(2) for g in range(2)]
    key = art.rollout_chunk_key("run", 2, 0)
    art.put_model(store, key, art.RolloutChunk(run_id="run", step=2, chunk=0, seed=1, weight_version=3, samples=samples))
    art.put_model(store, art.rewards_key("run", 2), art.StepRewards(
        run_id="run", step=2, rewards=[reward(s.sample_id, float(k % 2)) for k, s in enumerate(samples)]))
    stats = SamplingStats(rounds=1, prompts_drawn=2, groups_generated=2, groups_kept=2, groups_filtered_all_correct=0,
                          groups_filtered_all_wrong=0, groups_filtered_other=0, groups_trained=2, trained_reward_mean=0)
    inp = AssembleBatchInput(run_id="run", step=2, store_uri=uri, groups=[(0, 0), (0, 1)], group_size=2, chunk_size=4,
                             rounds=[SampledRound(chunk_keys=[key], rewards_key=art.rewards_key("run", 2))],
                             sampling=stats, epoch=1)
    raise_fence(store, "run", 1, "n0", from_step=1)
    assert ActivityEnvironment().run(assemble_batch, inp).n_samples == 4  # the current epoch writes
    store.delete_prefix("runs/run/steps/000002/batch/")
    raise_fence(store, "run", 2, "n1", from_step=2)
    with pytest.raises(ApplicationError) as err:
        ActivityEnvironment().run(assemble_batch, inp)
    assert err.value.type == Failure.NODE_LOST and "stale placement" in err.value.message
    assert store.list("runs/run/steps/000002/batch/") == []
