"""The sampling half of an RL step: rollout and rewards, with or without dynamic sampling.

Without ``rollout.dynamic_filter`` a step generates ``prompts_per_step`` groups and
scores them (``sample``). With it (DAPO's dynamic sampling, ``sample_with_filter``)
the step runs rounds: round ``r`` draws ``n = rollout.prompts_per_round`` new prompts at
positions ``cursor + r*n`` of the run's deterministic prompt order (a pure function of
the run seed, the step's committed cursor and ``r``), generates and scores them, and
learns from the reward activity which groups' rewards vary. Rounds stop once
``prompts_per_step`` varying groups are kept or after ``max_rounds``; the workflow then
picks the trained groups (``choose_groups``: every decision is made here, from
activity results recorded in history, so a retry or a replay picks the same ones). The
trained batch is that selection (``BatchSelection``: the rounds' keys and the chosen
groups), carried to the train step, which reads each round's chunks once and takes the
groups in memory. Every drawn prompt counts as used: the data cursor moves past all of
them, kept, filtered or surplus.

Rewards are scored where the samples are: on the run's node, which still holds the
chunks it just generated (``COMPUTE_REWARDS_ON_NODE``). With rollout nodes
(``engines.nodes``) the chunks are spread over them (``workflows.step_nodes``) and the
trainer's node scores them, reading them from the store.
"""

from __future__ import annotations

import math

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from spec.events import DynamicFilterEmpty
    from spec.trainer_rpc import SampledRound
    from workflows.contracts.sampling import (
        BatchSelection,
        RewardInput,
        RewardResult,
        RolloutInput,
        RolloutResult,
        Sampled,
        SamplingStats,
    )
    from workflows.agent_metrics import pool_agent_metrics
    from workflows.contracts.step import RLStepInput
    from workflows.failures import Failure, failure
    from workflows.step_nodes import StepNodes, rollout_spread
    from workflows.stubs import COMPUTE_REWARDS_ON_NODE, ROLLOUT


def more_rounds(kept: int, target: int, rounds_done: int, max_rounds: int) -> bool:
    """Whether dynamic sampling draws another round."""
    return kept < target and rounds_done < max_rounds


def choose_groups(varied: list[list[int]], target: int, first_round_groups: int) -> tuple[list[tuple[int, int]], bool]:
    """The (round, group) pairs to train: the varying groups in round order, at most
    ``target``; when none varies, the first round's first ``target`` groups as they are
    (the second item says so)."""
    kept = [(r, g) for r, groups in enumerate(varied) for g in groups]
    if kept:
        return kept[:target], False
    return [(0, g) for g in range(min(target, first_round_groups))], True


def pooled(results: list[RewardResult]) -> tuple[float, float, float]:
    """Mean, population std and accuracy over the samples of several reward results."""
    n = sum(r.n for r in results)
    if not n:
        return 0.0, 0.0, 0.0
    mean = sum(r.n * r.reward_mean for r in results) / n
    second = sum(r.n * (r.reward_std ** 2 + r.reward_mean ** 2) for r in results) / n
    return mean, math.sqrt(max(second - mean * mean, 0.0)), sum(r.n * r.accuracy for r in results) / n


def _rollout_input(inp: RLStepInput, round_: int = 0, cursor: int | None = None, n: int | None = None) -> RolloutInput:
    cfg = inp.config
    return RolloutInput(
        run_id=inp.run_id, step=inp.step, store_uri=cfg.store, seed=cfg.seed, policy_version=inp.policy_version,
        data_cursor=inp.data_cursor if cursor is None else cursor, dataset=inp.dataset, rollout=cfg.rollout,
        round=round_, n_prompts=n, epoch=inp.epoch,
    )


async def generate(inp: RLStepInput, nodes: StepNodes | None, rollout: RolloutInput, summary: str) -> RolloutResult:
    """A rollout on the run's engines: spread over its rollout nodes, or on the trainer's node."""
    if nodes is not None and nodes.spread:
        return await rollout_spread(nodes, rollout, inp.config, summary)
    return await ROLLOUT.run(rollout, queue=inp.node_queue, summary=summary)


async def score(inp: RLStepInput, rollout: RolloutResult, summary: str, round_: int = 0,
                group_size: int = 0) -> RewardResult:
    """The rollout's rewards, scored on the run's node (which holds its samples)."""
    cfg = inp.config
    arg = RewardInput(
        run_id=inp.run_id, step=inp.step, store_uri=cfg.store, chunk_keys=rollout.chunk_keys,
        dataset=inp.dataset, reward=cfg.reward, round=round_, group_size=group_size, epoch=inp.epoch,
    )
    return await COMPUTE_REWARDS_ON_NODE.run(arg, queue=inp.node_queue, summary=summary)


async def sample(inp: RLStepInput, nodes: StepNodes | None = None) -> Sampled:
    """One rollout of ``prompts_per_step`` prompts, then its rewards."""
    rollout = await generate(inp, nodes, _rollout_input(inp), f"rollout step {inp.step} @ v{inp.policy_version}")
    rewards = await score(inp, rollout, f"reward step {inp.step}")
    return Sampled(
        chunk_keys=rollout.chunk_keys, rewards_key=rewards.rewards_key, prompts=inp.config.rollout.prompts_per_step,
        reward_mean=rewards.reward_mean, reward_std=rewards.reward_std, accuracy=rewards.accuracy,
        reward_errors=rewards.errors, response_len_mean=rollout.response_len_mean,
        chunks_reused=rollout.chunks_reused, engine_retries=rollout.engine_retries,
        phases={"rollout": rollout.seconds, "reward": rewards.seconds}, node_events=rollout.node_events,
        policy_version=inp.policy_version, data_cursor=inp.data_cursor,
        agent=rollout.agent,
    )


Round = tuple[RolloutResult, RewardResult]


async def sample_with_filter(inp: RLStepInput, nodes: StepNodes | None = None) -> Sampled:
    """Rounds of rollout + rewards until ``prompts_per_step`` groups vary (or ``max_rounds``),
    then the trained batch of the chosen groups."""
    spec = inp.config.rollout
    rounds = await draw_rounds(inp, nodes)
    rewards = [rw for _, rw in rounds]
    groups, fallback = choose_groups([rw.varied_groups for rw in rewards], spec.prompts_per_step, rewards[0].groups)
    stats = sampling_stats(rounds, len(groups), fallback, spec.prompts_per_round)
    check_shortfall(inp, stats)
    selection = BatchSelection(
        rounds=[SampledRound(chunk_keys=got.chunk_keys, rewards_key=rw.rewards_key) for got, rw in rounds],
        groups=groups,
    )
    trained_mean = trained_reward_mean(rewards, groups)
    return pooled_batch(inp, rounds, stats.model_copy(update={"trained_reward_mean": trained_mean}), selection)


def trained_reward_mean(rewards: list[RewardResult], groups: list[tuple[int, int]]) -> float:
    """The mean reward of the trained groups, from each round's per-group means (the groups
    are of equal size)."""
    return math.fsum(rewards[r].group_means[g] for r, g in groups) / len(groups) if groups else 0.0


async def draw_rounds(inp: RLStepInput, nodes: StepNodes | None = None) -> list[Round]:
    """Dynamic sampling's rounds: round ``r`` generates and scores ``prompts_per_round`` new
    prompts from ``cursor + r*n``, until enough groups vary or ``max_rounds``."""
    spec = inp.config.rollout
    n = spec.prompts_per_round
    rounds: list[Round] = []
    kept = 0
    while more_rounds(kept, spec.prompts_per_step, len(rounds), spec.dynamic_filter.max_rounds):
        r = len(rounds)
        rollout = await generate(inp, nodes, _rollout_input(inp, r, inp.data_cursor + r * n, n),
                                 f"rollout step {inp.step} round {r}: {n} prompts @ v{inp.policy_version}")
        rewards = await score(inp, rollout, f"reward step {inp.step} round {r}", r, spec.group_size)
        rounds.append((rollout, rewards))
        kept += len(rewards.varied_groups)
    return rounds


def sampling_stats(rounds: list[Round], trained: int, fallback: bool, prompts_per_round: int) -> SamplingStats:
    """The step's dynamic-sampling counts (``trained_reward_mean`` is the trained batch's, filled in later)."""
    rewards = [rw for _, rw in rounds]
    return SamplingStats(
        rounds=len(rounds), prompts_drawn=len(rounds) * prompts_per_round,
        groups_generated=sum(rw.groups for rw in rewards), groups_kept=sum(len(rw.varied_groups) for rw in rewards),
        groups_filtered_all_correct=sum(rw.groups_all_correct for rw in rewards),
        groups_filtered_all_wrong=sum(rw.groups_all_wrong for rw in rewards),
        groups_filtered_other=sum(rw.groups_all_equal_other for rw in rewards),
        groups_trained=trained, trained_reward_mean=0.0, fallback=fallback,
    )


def check_shortfall(inp: RLStepInput, stats: SamplingStats) -> None:
    """Fail the run (``SamplingShortfall``) when too few groups varied and
    ``rollout.dynamic_filter.on_shortfall`` is fail."""
    spec = inp.config.rollout
    if stats.groups_kept >= spec.prompts_per_step or spec.dynamic_filter.on_shortfall != "fail":
        return
    raise failure(
        Failure.SAMPLING_SHORTFALL,
        f"step {inp.step}: dynamic sampling kept {stats.groups_kept} of {spec.prompts_per_step} groups after "
        f"{stats.rounds} rounds of {spec.prompts_per_round} prompts ({stats.groups_filtered_all_correct} all correct, "
        f"{stats.groups_filtered_all_wrong} all wrong, {stats.groups_filtered_other} other groups filtered); "
        "rollout.dynamic_filter.on_shortfall is fail (raise max_rounds or oversample, or set it to train)",
        final=True,
    )


def pooled_batch(inp: RLStepInput, rounds: list[Round], stats: SamplingStats, selection: BatchSelection) -> Sampled:
    """The step's batch: the kept groups (a ``selection`` of the rounds' chunks), with the
    rewards and metrics of every round."""
    rollouts = [got for got, _ in rounds]
    rewards = [rw for _, rw in rounds]
    mean, std, accuracy = pooled(rewards)
    events = [e for got in rollouts for e in got.node_events]
    if stats.fallback:
        events.append(DynamicFilterEmpty(at=workflow.now().isoformat(), step=inp.step, rounds=len(rounds),
                                         groups_trained=stats.groups_trained))
    samples = sum(rw.n for rw in rewards)
    phases = {"rollout": sum(got.seconds for got in rollouts), "reward": sum(rw.seconds for rw in rewards)}
    return Sampled(
        chunk_keys=[], rewards_key="", selection=selection, prompts=stats.prompts_drawn,
        reward_mean=mean, reward_std=std, accuracy=accuracy, reward_errors=sum(rw.errors for rw in rewards),
        response_len_mean=sum(got.response_len_mean * got.n_samples for got in rollouts) / max(1, samples),
        chunks_reused=sum(got.chunks_reused for got in rollouts),
        engine_retries=sum(got.engine_retries for got in rollouts),
        phases=phases,
        node_events=events,
        agent=pool_agent_metrics([got.agent for got in rollouts if got.agent]),
        sampling=stats,
        policy_version=inp.policy_version, data_cursor=inp.data_cursor,
    )


async def sample_step(inp: RLStepInput, nodes: StepNodes | None = None) -> Sampled:
    """The step's batch: with or without dynamic sampling (``nodes``: the run's rollout nodes, if any)."""
    return await (sample_with_filter(inp, nodes) if inp.config.rollout.dynamic_filter.enabled else sample(inp, nodes))
