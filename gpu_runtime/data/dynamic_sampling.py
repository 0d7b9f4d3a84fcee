"""Dynamic sampling (DAPO) on stored artifacts: which groups of a round carry a learning
signal, and the trained batch: the groups the workflow kept, taken from the rounds' samples
(by the trainer, in memory).

A group is the ``group_size`` consecutive samples of one prompt (the rollout's order).
Its rewards "vary" unless they are all equal; an all-equal group gets zero advantage
under every group-relative estimator, so it is filtered.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpu_runtime.store.artifacts import Sample, SampleReward


@dataclass
class GroupStats:
    groups: int = 0
    varied: list[int] = field(default_factory=list)  # indices of the groups whose rewards vary
    all_correct: int = 0  # all rewards equal, every sample correct
    all_wrong: int = 0  # all rewards equal, no sample correct
    all_equal_other: int = 0  # all rewards equal, correctness mixed (e.g. a format-only reward)
    means: list[float] = field(default_factory=list)  # each group's mean reward, in order


def group_stats(rewards: Sequence[SampleReward], group_size: int) -> GroupStats:
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    out = GroupStats(groups=len(rewards) // group_size)
    for g in range(out.groups):
        grp = rewards[g * group_size : (g + 1) * group_size]
        values = [r.reward for r in grp]
        out.means.append(statistics.fmean(values))
        if max(values) != min(values):
            out.varied.append(g)
        elif all(r.correct for r in grp):
            out.all_correct += 1
        elif not any(r.correct for r in grp):
            out.all_wrong += 1
        else:
            out.all_equal_other += 1
    return out


def assemble_groups(
    rounds: Sequence[tuple[Sequence[Sample], Sequence[SampleReward]]],
    groups: Sequence[tuple[int, int]],
    group_size: int,
) -> tuple[list[Sample], list[SampleReward]]:
    """The samples and rewards of ``groups`` ((round, group index) pairs), in that order.
    ``rounds[r]`` holds round r's samples and their rewards, both in rollout order."""
    samples: list[Sample] = []
    rewards: list[SampleReward] = []
    for r, g in groups:
        if not 0 <= r < len(rounds):
            raise ValueError(f"group ({r}, {g}): no round {r} (the step has {len(rounds)})")
        round_samples, round_rewards = rounds[r]
        if len(round_samples) != len(round_rewards):
            raise ValueError(f"round {r}: {len(round_samples)} samples but {len(round_rewards)} rewards")
        lo, hi = g * group_size, (g + 1) * group_size
        if g < 0 or hi > len(round_samples):
            raise ValueError(f"group ({r}, {g}): round {r} has {len(round_samples) // group_size} groups")
        for s, w in zip(round_samples[lo:hi], round_rewards[lo:hi], strict=True):
            if s.sample_id != w.sample_id:
                raise ValueError(f"round {r}: reward of {w.sample_id} stored against sample {s.sample_id}")
        samples.extend(round_samples[lo:hi])
        rewards.extend(round_rewards[lo:hi])
    return samples, rewards
