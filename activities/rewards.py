"""Scoring a rollout's samples: the body of the reward activity, wherever it runs.

The run's node agent scores the samples it just generated
(``RolloutActivities.compute_rewards_on_node``, from memory, reading from the store only the
chunks it does not hold) through ``score``.
"""

from __future__ import annotations

import statistics
import time

from activities.heartbeat import with_heartbeat
from gpu_runtime.data.dynamic_sampling import group_stats
from gpu_runtime.data.rewards import (
    RewardError, RewardFatal, RewardFunctionNotFound, ScoreContext, ScoreStats, score_samples,
)
from gpu_runtime.proc import metrics
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.fence import FencedStore
from workflows.contracts.sampling import RewardInput, RewardResult
from workflows.failures import Failure, failure

def score(inp: RewardInput, fenced: FencedStore, samples: list[art.Sample], rows: list[dict],
          started: float) -> RewardResult:
    """Score ``samples`` with the run's reward and store them (``rewards.json`` of the step,
    or of the dynamic-sampling round). A ``judge`` reward records each sample's result in the
    store first, so a retry never asks the endpoint again for a sample it judged. Every write
    goes through ``fenced``, at the step's placement epoch: a write the fence refuses raises
    ``StaleEpoch`` (the run has moved to a newer placement), for the caller to report."""
    ctx = ScoreContext(store=fenced, judge_prefix=art.judge_prefix(inp.run_id, inp.step, inp.round))
    stats = ScoreStats()
    try:
        rewards = with_heartbeat(lambda: score_samples(samples, dict(enumerate(rows)), inp.reward, ctx, stats))
    except RewardFunctionNotFound as err:  # the same on every attempt: fail the run, naming the field
        raise failure(Failure.INVALID_INPUT, f"reward.function: {err}") from err
    except RewardFatal as err:  # a 4xx, junk from an endpoint, error_policy fail, an unreadable label
        raise failure(Failure.REWARD_ERROR, str(err), final=True) from err
    except RewardError as err:  # an endpoint down, a dead reward process: retried
        raise failure(Failure.REWARD_ERROR, str(err)) from err
    finally:
        metrics.REWARD_JUDGE_CALLS.inc(stats.judged)
    key = art.rewards_key(inp.run_id, inp.step, inp.round)
    art.put_model(fenced, key, art.StepRewards(run_id=inp.run_id, step=inp.step, rewards=rewards))
    result = summary(inp, key, rewards, stats.errors, time.perf_counter() - started)
    metrics.REWARD_MEAN.set(result.reward_mean)
    metrics.REWARD_STD.set(result.reward_std)
    metrics.REWARD_ERRORS.inc(stats.errors)
    metrics.PHASE_SECONDS.labels("reward").observe(result.seconds)
    return result


def summary(inp: RewardInput, key: str, rewards: list[art.SampleReward], errors: int, seconds: float) -> RewardResult:
    """The reward activity's result: statistics, and with ``group_size`` each group's fate
    and mean reward (what dynamic sampling decides and reports from; a few floats a group)."""
    values = [r.reward for r in rewards]
    result = RewardResult(
        rewards_key=key,
        reward_mean=statistics.fmean(values) if values else 0.0,
        reward_std=statistics.pstdev(values) if len(values) > 1 else 0.0,
        accuracy=sum(r.correct for r in rewards) / max(1, len(rewards)),
        n=len(rewards),
        seconds=seconds,
        errors=errors,
    )
    if not inp.group_size:
        return result
    try:
        groups = group_stats(rewards, inp.group_size)
    except ValueError as err:
        raise failure(Failure.INVALID_INPUT, f"step {inp.step} round {inp.round}: {err}") from err
    return result.model_copy(update={
        "groups": groups.groups, "varied_groups": groups.varied, "groups_all_correct": groups.all_correct,
        "groups_all_wrong": groups.all_wrong, "groups_all_equal_other": groups.all_equal_other,
        "group_means": groups.means,
    })
