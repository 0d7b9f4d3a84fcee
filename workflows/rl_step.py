"""``RLStep``: one RL step as a child workflow (id ``<run-id>/step-<n>``); in mode sft
one SFT step (no rollout or reward: train_step on ``sft.batch_size`` dataset rows).

rollout -> reward (``workflows.sampling``: rounds of both with dynamic sampling, then
the kept groups as the step's batch) -> train_step -> update_weights -> checkpoint
(every k steps) -> evaluate (every k steps, on the held-out split, after the checkpoint: the
step's durable state is saved before the observational eval, which cannot then
delay or lose it).
"""

from __future__ import annotations

import asyncio
import contextlib

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows.contracts.cells import RestartCellsInput, RestartCellsResult
    from workflows.contracts.events import RunEvent
    from workflows.contracts.sampling import Sampled
    from workflows.contracts.step import RLStepInput, StepSummary
    from workflows.contracts.training import (
        CheckpointInput,
        CheckpointResult,
        EvalInput,
        EvalResult,
        SFTRowsInput,
        TrainStepInput,
        UpdateWeightsInput,
    )
    from workflows.failures import Failure, failure_in
    from workflows.rollout_schedule import buffer_depth, buffered, check_batch, steps_ahead
    from workflows.sampling import sample_step
    from workflows.stubs import CHECKPOINT, EVALUATE, RESTART_CELLS, TRAIN_STEP, UPDATE_WEIGHTS

EVAL_PATCH = "eval-activity"  # steps recorded before the eval existed replay without it
SFT_MODE_PATCH = "sft-mode"  # mode sft: the step trains on dataset rows, without rollout and reward


@workflow.defn(name="RLStep")
class RLStep:
    @workflow.run
    async def run(self, inp: RLStepInput) -> StepSummary:
        cfg, node, store = inp.config, inp.node_queue, inp.config.store
        started = workflow.now()

        sft_rows: SFTRowsInput | None = None
        if cfg.mode == "sft" and workflow.patched(SFT_MODE_PATCH):  # no sampling: the rows' labels
            sft_rows = SFTRowsInput(data_cursor=inp.data_cursor, n_rows=cfg.sft.batch_size)
            sampled = Sampled(chunk_keys=[], rewards_key="", prompts=cfg.sft.batch_size, reward_mean=0.0,
                              reward_std=0.0, accuracy=0.0, reward_errors=0, response_len_mean=0.0,
                              chunks_reused=0, engine_retries=0, phases={},
                              policy_version=inp.policy_version, data_cursor=inp.data_cursor)
        # lost DP cells whose backoff is over start again while the step samples, and join its train_step
        heal = asyncio.create_task(restart_cells(inp)) if inp.restart_cells else None
        depth = buffer_depth(cfg)
        rest: list[Sampled] = []
        try:
            if sft_rows is None:
                buffer = buffered(inp)
                if buffer:  # sampled during an earlier step: the oldest is this step's
                    sampled, rest = buffer[0], buffer[1:]
                    bad = check_batch(sampled, inp, depth)
                    if bad is not None:
                        raise bad
                else:
                    sampled = await sample_step(inp)
            restarted = await heal if heal is not None else None
        except BaseException:
            await _cancel(heal)
            raise
        cursor = inp.data_cursor + sampled.prompts
        # one_step_off / fully_async: later steps' batches are sampled during this train_step, on the
        # weights the engines serve now (this step's); update_weights waits for them (the engines serve
        # one version). Which ones is a function of the step number and the depth (rollout_schedule).
        ahead = None
        later = steps_ahead(inp.step, cfg.steps, len(rest), depth)
        if later:
            start = rest[-1].data_cursor + rest[-1].prompts if rest else cursor
            ahead = asyncio.create_task(sample_ahead(inp, later, start))
        try:
            trained = await TRAIN_STEP.run(
                TrainStepInput(
                    run_id=inp.run_id, step=inp.step, store_uri=store, policy_version=inp.policy_version,
                    chunk_keys=sampled.chunk_keys, rewards_key=sampled.rewards_key,
                    group_size=cfg.rollout.group_size, train=inp.train, sft_rows=sft_rows, epoch=inp.epoch,
                ),
                queue=node, summary=f"train step {inp.step} -> v{inp.policy_version + 1}",
            )
            sampled_ahead = await ahead if ahead is not None else []
        except BaseException:
            await _cancel(ahead)  # the step is re-run as a whole: stop its prefetch
            raise
        synced = await UPDATE_WEIGHTS.run(
            UpdateWeightsInput(
                run_id=inp.run_id, store_uri=store, policy_version=trained.policy_version,
                weights_key=trained.weights_key, checksum=trained.checksum, engines=cfg.engines,
            ),
            queue=node, summary=f"update weights v{trained.policy_version}",
        )
        ckpt: CheckpointResult | None = None
        if inp.step % cfg.checkpoint.every == 0 or inp.step == cfg.steps:
            ckpt = await CHECKPOINT.run(
                CheckpointInput(
                    run_id=inp.run_id, step=inp.step, store_uri=store,
                    data_cursor=cursor, epoch=inp.epoch,
                ),
                queue=node, summary=f"checkpoint step {inp.step}",
            )

        evaluated: EvalResult | None = None
        eval_events: list[RunEvent] = []
        if inp.dataset.eval_key and cfg.eval.due(inp.step, cfg.steps) and workflow.patched(EVAL_PATCH):
            evaluated, eval_events = await evaluate(inp, trained.policy_version)

        phases = {
            **sampled.phases,
            "train": trained.seconds,
            "update_weights": synced.seconds,
            "checkpoint": ckpt.seconds if ckpt else 0.0,
            **({"eval": evaluated.seconds} if evaluated else {}),
        }
        m = trained.metrics
        return StepSummary(
            step=inp.step,
            policy_version=trained.policy_version,
            data_cursor=cursor,
            reward_mean=sampled.reward_mean,
            reward_std=sampled.reward_std,
            accuracy=sampled.accuracy,
            loss=m.get("loss", 0.0),
            kl=m.get("kl", 0.0),
            grad_norm=m.get("grad_norm", 0.0),
            response_len_mean=sampled.response_len_mean,
            chunks_reused=sampled.chunks_reused,
            engine_retries=sampled.engine_retries,
            step_seconds=(workflow.now() - started).total_seconds(),
            phase_seconds=phases,
            activity_seconds=sum(phases.values()),
            checkpointed=ckpt is not None,
            weights_key=trained.weights_key,
            restored_from_step=trained.restored_from_step,
            replayed_steps=trained.replayed_steps,
            cell=trained.cell,
            events=[
                *sampled.node_events, *trained.node_events, *synced.node_events, *(ckpt.node_events if ckpt else []),
                *(evaluated.node_events if evaluated else []), *eval_events,
                *(restarted.node_events if restarted else []),
            ],
            engines=synced.engines,
            eval_greedy=evaluated.greedy_accuracy if evaluated else None,
            eval_pass_at_k=evaluated.pass_at_k if evaluated else None,
            eval_k=evaluated.k if evaluated else None,
            eval_n=evaluated.n if evaluated else None,
            reward_errors=sampled.reward_errors,
            sampling=sampled.sampling,
            rollout_version=sampled.policy_version,
            overlap_seconds=min(trained.seconds, sum(sum(b.phases.values()) for b in sampled_ahead)),
            buffer_depth=len(rest) + len(sampled_ahead),
            next_buffer=[*rest, *sampled_ahead],
            agent=sampled.agent,
            dp=trained.dp,
            dp_cells=int(m["dp_cells"]) if "dp_cells" in m else None,
            cell_restarts=restarted.outcome if restarted else {},
        )


async def _cancel(task: asyncio.Task | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def restart_cells(inp: RLStepInput) -> RestartCellsResult:
    """Start the lost DP cells whose backoff is over (``workflows.cell_heal``) on the trainer's
    node; each heals from a peer in this step's quorum. A restart that fails is an outcome,
    not an error: the run backs off and tries again at a later step."""
    return await RESTART_CELLS.run(
        RestartCellsInput(run_id=inp.run_id, store_uri=inp.config.store, cells=inp.restart_cells, epoch=inp.epoch),
        queue=inp.node_queue, summary=f"restart DP cells {inp.restart_cells}",
    )


async def sample_ahead(inp: RLStepInput, steps: list[int], cursor: int) -> list[Sampled]:
    """The batches of ``steps``, one after another on the engines' current weights, each
    drawing its prompts where the one before stopped (dynamic sampling may draw more)."""
    out: list[Sampled] = []
    for step in steps:
        out.append(await sample_step(
            inp.model_copy(update={"step": step, "data_cursor": cursor, "prefetched": None, "buffer": []})
        ))
        cursor = out[-1].data_cursor + out[-1].prompts
    return out


async def evaluate(inp: RLStepInput, version: int) -> tuple[EvalResult | None, list[RunEvent]]:
    """The held-out eval of ``version`` (the engines serve it since ``update_weights``).
    An eval that fails after its retries costs the step its eval numbers, not the run:
    the step commits with an ``eval_failed`` event. A lost node still re-places the step."""
    cfg = inp.config
    assert inp.dataset.eval_key is not None
    try:
        result = await EVALUATE.run(
            EvalInput(
                run_id=inp.run_id, step=inp.step, store_uri=cfg.store, seed=cfg.seed, policy_version=version,
                eval_key=inp.dataset.eval_key, k=cfg.eval.k, temperature=cfg.eval.temperature,
                max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                chunk_size=cfg.rollout.chunk_size, epoch=inp.epoch,
                stop=cfg.rollout.stop, stop_token_ids=cfg.rollout.stop_token_ids,
            ),
            queue=inp.node_queue,
            summary=f"evaluate v{version}: {inp.dataset.n_eval} held-out prompts, greedy and pass@{cfg.eval.k}",
        )
        return result, []
    except (ActivityError, ApplicationError) as err:
        kind, message = failure_in(err)
        if kind == Failure.NODE_LOST:
            raise
        if kind is None:  # not one of ours: the innermost cause says what happened
            cause: BaseException = err
            while cause.__cause__ is not None:
                cause = cause.__cause__
            message = f"{getattr(cause, 'type', None) or type(cause).__name__}: {cause}"
        workflow.logger.warning("eval of step %d failed: %s", inp.step, message)
        return None, [RunEvent(at=workflow.now().isoformat(), kind="eval_failed", detail=f"step {inp.step}: {message}")]
