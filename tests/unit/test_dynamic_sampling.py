"""Dynamic sampling: which groups vary, the trained groups taken from the rounds in the
workflow's order, and the keys, seeds and sample ids of a rollout round."""

from __future__ import annotations


import pytest

from gpu_runtime.data.dynamic_sampling import assemble_groups, group_stats
from gpu_runtime.rollout.chunks import plan_chunks
from gpu_runtime.rollout.request import RolloutRequest
from gpu_runtime.store import artifacts as art
from spec.rollout import RolloutSpec
from workflows.contracts.sampling import SamplingStats


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
