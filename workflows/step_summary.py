"""A step's ``StepSummary``, built from what its phases returned: a pure function of
the activities' results (recorded in history), so a replay rebuilds the same summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spec.events import RunEvent
from workflows.contracts.cells import RestartCellsResult
from workflows.contracts.sampling import Sampled
from workflows.contracts.step import RLStepInput, StepSummary
from workflows.contracts.training import CheckpointResult, EvalResult, TrainStepResult, UpdateWeightsResult


@dataclass(frozen=True, kw_only=True)
class StepResults:
    """What a step's phases returned."""

    inp: RLStepInput
    seconds: float  # the step's time, start to end, in workflow time
    cursor: int  # the data cursor after the step
    trained: TrainStepResult
    synced: UpdateWeightsResult
    sampled: Sampled | None = None  # the trained batch; None: an SFT step (no rollout, no reward)
    checkpoint: CheckpointResult | None = None
    evaluated: EvalResult | None = None
    eval_events: list[RunEvent] = field(default_factory=list)  # an eval that failed
    restarted: RestartCellsResult | None = None  # the DP cells restarted before the step trained
    buffered: list[Sampled] = field(default_factory=list)  # batches still buffered after the step took its own
    sampled_ahead: list[Sampled] = field(default_factory=list)  # later steps' batches sampled during its train_step
    lost_rollout_queues: list[str] = field(default_factory=list)  # rollout nodes lost during the step


def summarize(r: StepResults) -> StepSummary:
    trained, metrics = r.trained, r.trained.metrics
    phases = phase_seconds(r)
    return StepSummary(
        step=r.inp.step,
        policy_version=trained.policy_version,
        data_cursor=r.cursor,
        loss=metrics.get("loss", 0.0),
        kl=metrics.get("kl", 0.0),
        grad_norm=metrics.get("grad_norm", 0.0),
        rollout_logprob_abs_diff=metrics.get("rollout_logprob_abs_diff", 0.0),
        rollout_logprob_abs_diff_max=metrics.get("rollout_logprob_abs_diff_max", 0.0),
        step_seconds=r.seconds,
        phase_seconds=phases,
        activity_seconds=sum(phases.values()),
        checkpointed=r.checkpoint is not None,
        weights_key=r.checkpoint.weights_key if r.checkpoint else "",
        restored_from_step=trained.restored_from_step,
        replayed_steps=trained.replayed_steps,
        cell=trained.cell,
        events=events(r),
        engines=r.synced.engines,
        **sampling_fields(r.sampled, r.inp.policy_version),
        **eval_fields(r.evaluated),
        overlap_seconds=min(trained.seconds, sum(sum(b.phases.values()) for b in r.sampled_ahead)),
        buffer_depth=len(r.buffered) + len(r.sampled_ahead),
        next_buffer=[*r.buffered, *r.sampled_ahead],
        dp=trained.dp,
        dp_cells=int(metrics["dp_cells"]) if "dp_cells" in metrics else None,
        cell_restarts=r.restarted.outcome if r.restarted else {},
        lost_rollout_queues=list(r.lost_rollout_queues),
        checksum=trained.checksum,
    )


def phase_seconds(r: StepResults) -> dict[str, float]:
    """Each phase's activity seconds, in the order they ran."""
    return {
        **(r.sampled.phases if r.sampled else {}),
        "train": r.trained.seconds,
        "update_weights": r.synced.seconds,
        "checkpoint": r.checkpoint.seconds if r.checkpoint else 0.0,
        **({"eval": r.evaluated.seconds} if r.evaluated else {}),
    }


def events(r: StepResults) -> list[RunEvent]:
    """The nodes' events of every phase, then the step's own."""
    return [
        *(r.sampled.node_events if r.sampled else []), *r.trained.node_events, *r.synced.node_events,
        *(r.checkpoint.node_events if r.checkpoint else []), *(r.evaluated.node_events if r.evaluated else []),
        *r.eval_events, *(r.restarted.node_events if r.restarted else []),
    ]


def sampling_fields(sampled: Sampled | None, version: int) -> dict[str, Any]:
    """What the summary reports of the trained batch's sampling. An SFT step sampled
    nothing: no rewards, and its rows are read at the version it trains from."""
    if sampled is None:
        return {"reward_mean": 0.0, "reward_std": 0.0, "accuracy": 0.0, "rollout_version": version}
    return {
        "reward_mean": sampled.reward_mean, "reward_std": sampled.reward_std, "accuracy": sampled.accuracy,
        "response_len_mean": sampled.response_len_mean, "chunks_reused": sampled.chunks_reused,
        "engine_retries": sampled.engine_retries, "reward_errors": sampled.reward_errors,
        "sampling": sampled.sampling, "rollout_version": sampled.policy_version, "agent": sampled.agent,
    }


def eval_fields(evaluated: EvalResult | None) -> dict[str, Any]:
    if evaluated is None:
        return {}
    return {"eval_greedy": evaluated.greedy_accuracy, "eval_pass_at_k": evaluated.pass_at_k,
            "eval_sampled": evaluated.sampled_accuracy,
            "eval_k": evaluated.k, "eval_n": evaluated.n}
