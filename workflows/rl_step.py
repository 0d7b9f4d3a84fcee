"""``RLStep``: one RL step as a child workflow (id ``<run-id>/step-<n>``).

rollout -> reward -> train_step -> update_weights -> checkpoint (every k steps).
"""

from __future__ import annotations

from typing import TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, TimeoutError, TimeoutType

with workflow.unsafe.imports_passed_through():
    from pydantic import BaseModel

    from workflows.contracts import (
        CONTROL_QUEUE,
        CheckpointInput,
        CheckpointResult,
        RewardInput,
        RewardResult,
        RLStepInput,
        RolloutInput,
        RolloutResult,
        StepSummary,
        TrainStepInput,
        TrainStepResult,
        UpdateWeightsInput,
        UpdateWeightsResult,
    )
    from workflows.failures import Failure, failure
    from workflows.policies import TIMINGS

R = TypeVar("R", bound=BaseModel)


async def run_activity(name: str, arg: BaseModel, result_type: type[R], *, task_queue: str, summary: str) -> R:
    """Execute an activity with its timing policy; a node nobody polls becomes ``NodeLost``."""
    t = TIMINGS[name]
    try:
        return await workflow.execute_activity(
            name,
            arg,
            result_type=result_type,
            task_queue=task_queue,
            start_to_close_timeout=t.start_to_close,
            heartbeat_timeout=t.heartbeat,
            schedule_to_start_timeout=t.schedule_to_start,
            retry_policy=t.retry,
            summary=summary,
        )
    except ActivityError as err:
        cause = err.cause
        if isinstance(cause, TimeoutError) and cause.type in (TimeoutType.SCHEDULE_TO_START, TimeoutType.HEARTBEAT):
            raise failure(
                Failure.NODE_LOST, f"node queue {task_queue} did not run {name}: {cause.type.name}", task_queue
            ) from err
        raise


@workflow.defn(name="RLStep")
class RLStep:
    @workflow.run
    async def run(self, inp: RLStepInput) -> StepSummary:
        cfg, node, store = inp.config, inp.node_queue, inp.config.store
        started = workflow.now()

        rollout = await run_activity(
            "rollout",
            RolloutInput(
                run_id=inp.run_id, step=inp.step, store_uri=store, seed=cfg.seed,
                policy_version=inp.policy_version, data_cursor=inp.data_cursor,
                dataset=inp.dataset, rollout=cfg.rollout,
            ),
            RolloutResult, task_queue=node, summary=f"rollout step {inp.step} @ v{inp.policy_version}",
        )
        rewards = await run_activity(
            "compute_rewards",
            RewardInput(
                run_id=inp.run_id, step=inp.step, store_uri=store, chunk_keys=rollout.chunk_keys,
                dataset=inp.dataset, reward=cfg.reward,
            ),
            RewardResult, task_queue=CONTROL_QUEUE, summary=f"reward step {inp.step}",
        )
        trained = await run_activity(
            "train_step",
            TrainStepInput(
                run_id=inp.run_id, step=inp.step, store_uri=store, policy_version=inp.policy_version,
                chunk_keys=rollout.chunk_keys, rewards_key=rewards.rewards_key,
                group_size=cfg.rollout.group_size, train=inp.train,
            ),
            TrainStepResult, task_queue=node, summary=f"train step {inp.step} -> v{inp.policy_version + 1}",
        )
        synced = await run_activity(
            "update_weights",
            UpdateWeightsInput(
                run_id=inp.run_id, store_uri=store, policy_version=trained.policy_version,
                weights_key=trained.weights_key, checksum=trained.checksum, engines=cfg.engines,
            ),
            UpdateWeightsResult, task_queue=node, summary=f"update weights v{trained.policy_version}",
        )
        ckpt: CheckpointResult | None = None
        if inp.step % cfg.checkpoint.every == 0 or inp.step == cfg.steps:
            ckpt = await run_activity(
                "checkpoint",
                CheckpointInput(
                    run_id=inp.run_id, step=inp.step, store_uri=store,
                    data_cursor=inp.data_cursor + cfg.rollout.prompts_per_step,
                ),
                CheckpointResult, task_queue=node, summary=f"checkpoint step {inp.step}",
            )

        phases = {
            "rollout": rollout.seconds,
            "reward": rewards.seconds,
            "train": trained.seconds,
            "update_weights": synced.seconds,
            "checkpoint": ckpt.seconds if ckpt else 0.0,
        }
        m = trained.metrics
        return StepSummary(
            step=inp.step,
            policy_version=trained.policy_version,
            data_cursor=inp.data_cursor + cfg.rollout.prompts_per_step,
            reward_mean=rewards.reward_mean,
            reward_std=rewards.reward_std,
            accuracy=rewards.accuracy,
            loss=m.get("loss", 0.0),
            kl=m.get("kl", 0.0),
            grad_norm=m.get("grad_norm", 0.0),
            response_len_mean=rollout.response_len_mean,
            chunks_reused=rollout.chunks_reused,
            engine_retries=rollout.engine_retries,
            step_seconds=(workflow.now() - started).total_seconds(),
            phase_seconds=phases,
            activity_seconds=sum(phases.values()),
            checkpointed=ckpt is not None,
            weights_key=trained.weights_key,
            restored_from_step=trained.restored_from_step,
            replayed_steps=trained.replayed_steps,
            events=[*rollout.node_events, *trained.node_events, *synced.node_events, *(ckpt.node_events if ckpt else [])],
            engines=synced.engines,
        )
