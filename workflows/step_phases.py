"""The phases a step child (``RLStep``, ``SFTStep``) shares after it has its batch:
train -> update weights -> checkpoint (every k steps) -> evaluate (every k steps, on
the held-out split, after the checkpoint: the step's durable state is saved before the
observational eval, which cannot then delay or lose it), and the restart of lost DP
cells that joins the train step. One awaited activity each, through its stub."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import datetime

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from spec.events import EvalFailed, RunEvent
    from spec.trainer_rpc import SFTRows, StepBatch
    from workflows.contracts.cells import RestartCellsInput, RestartCellsResult
    from workflows.contracts.sampling import Sampled
    from workflows.contracts.step import RLStepInput
    from workflows.contracts.training import (
        CheckpointInput, CheckpointResult, EvalInput, EvalResult, TrainStepInput, TrainStepResult,
        UpdateWeightsInput, UpdateWeightsResult,
    )
    from workflows.disk_wait import waiting_for_disk
    from workflows.failures import Failure, failure_in
    from workflows.rollout_push import broadcast_to_rollout_nodes, push_to_rollout_nodes
    from workflows.step_nodes import StepNodes
    from workflows.stubs import CHECKPOINT, EVALUATE, RESTART_CELLS, TRAIN_STEP, UPDATE_WEIGHTS


def seconds_since(started: datetime) -> float:
    return (workflow.now() - started).total_seconds()


async def cancel(task: asyncio.Task | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


@contextlib.asynccontextmanager
async def cancelled_on_error(task: asyncio.Task | None) -> AsyncIterator[None]:
    """Cancel ``task`` (work started beside the block's) when the block fails: the step is
    re-run as a whole."""
    try:
        yield
    except BaseException:
        await cancel(task)
        raise


async def restart_cells(inp: RLStepInput) -> RestartCellsResult:
    """Start the lost DP cells whose backoff is over (``workflows.cell_heal``) on the trainer's
    node; each heals from a peer in this step's quorum. A restart that fails is an outcome,
    not an error: the run backs off and tries again at a later step."""
    return await waiting_for_disk(lambda: RESTART_CELLS.run(
        RestartCellsInput(run_id=inp.run_id, store_uri=inp.config.store, cells=inp.restart_cells, epoch=inp.epoch),
        queue=inp.node_queue, summary=f"restart DP cells {inp.restart_cells}",
    ), f"restart DP cells {inp.restart_cells}")


def start_cell_restarts(inp: RLStepInput) -> asyncio.Task[RestartCellsResult] | None:
    """The due cells' restart, started beside the step's sampling (None: none is due)."""
    return asyncio.create_task(restart_cells(inp)) if inp.restart_cells else None


async def train(inp: RLStepInput, sampled: Sampled | None, sft_rows: SFTRows | None = None) -> TrainStepResult:
    """The trainer's step on the sampled batch: its chunks and their rewards, or the kept
    groups of its rounds (dynamic sampling); or, in mode sft, on ``sft_rows``."""
    return await waiting_for_disk(lambda: TRAIN_STEP.run(
        TrainStepInput(
            run_id=inp.run_id, store_uri=inp.config.store, epoch=inp.epoch,
            batch=StepBatch(
                step=inp.step, policy_version=inp.policy_version,
                chunk_keys=sampled.chunk_keys if sampled else [], rewards_key=sampled.rewards_key if sampled else "",
                group_size=inp.config.rollout.group_size, hparams=inp.train, sft=sft_rows,
                selection=sampled.selection if sampled else None,
                temperature=trained_temperature(inp) if sampled else 1.0,
            ),
            sampling=sampled.sampling if sampled else None,
        ),
        queue=inp.node_queue, summary=f"train step {inp.step} -> v{inp.policy_version + 1}",
    ), f"train step {inp.step}")


def trained_temperature(inp: RLStepInput) -> float:
    """The temperature the trainer divides the logits by: the rollout's; 1 for a greedy rollout
    (``temperature: 0``, which a new RL run refuses), whose engines report log_softmax(logits)."""
    t = inp.config.rollout.temperature
    return t if t > 0 else 1.0


async def update_weights(inp: RLStepInput, trained: TrainStepResult, nodes: StepNodes | None = None) -> UpdateWeightsResult:
    """The trained version to every engine (empty slots restarted first), checksums compared: on
    the trainer's node, or on every live rollout node (``workflows.rollout_push``), each pulling
    it from the trainer's node, or, ``engines.weight_sync: distributed``, broadcast to them all
    by the trainer."""
    update = UpdateWeightsInput(
        run_id=inp.run_id, store_uri=inp.config.store, policy_version=trained.policy_version,
        checksum=trained.checksum, engines=inp.config.engines,
    )
    summary = f"update weights v{trained.policy_version}"
    if nodes is None or not nodes.spread:  # the trainer's own engines: its export, linked (or broadcast)
        return await UPDATE_WEIGHTS.run(update, queue=inp.node_queue, summary=summary)
    update = update.model_copy(update={"source_url": inp.weights_url})  # rollout nodes pull from the trainer's
    if update.engines.weight_sync == "distributed" and nodes.live:
        return await broadcast_to_rollout_nodes(inp, nodes, update, summary)
    return await push_to_rollout_nodes(nodes, update, summary)


async def checkpoint_if_due(inp: RLStepInput, cursor: int) -> CheckpointResult | None:
    """The step's checkpoint every ``checkpoint.every`` steps, after the last one and after the
    steps whose version the store keeps (``checkpoint.keep_versions``) (a full disk: it waits
    for space, ``workflows.disk_wait``; so do the train step and a cell restart)."""
    cfg = inp.config
    if inp.step % cfg.checkpoint.every != 0 and inp.step != cfg.steps and inp.step not in cfg.checkpoint.keep_versions:
        return None
    return await waiting_for_disk(lambda: CHECKPOINT.run(
        CheckpointInput(run_id=inp.run_id, step=inp.step, store_uri=cfg.store, data_cursor=cursor, epoch=inp.epoch,
                        durable=inp.step == cfg.steps),
        queue=inp.node_queue, summary=f"checkpoint step {inp.step}",
    ), f"checkpoint step {inp.step}")


async def evaluate_if_due(inp: RLStepInput, version: int,
                          nodes: StepNodes | None = None) -> tuple[EvalResult | None, list[RunEvent]]:
    """The held-out eval when the step is due one (``eval.every``, and the run has a held-out
    split)."""
    cfg = inp.config
    if inp.dataset.eval_key and cfg.eval.due(inp.step, cfg.steps):
        return await evaluate(inp, version, nodes)
    return None, []


async def evaluate(inp: RLStepInput, version: int,
                   nodes: StepNodes | None = None) -> tuple[EvalResult | None, list[RunEvent]]:
    """The held-out eval of ``version`` (the engines serve it since ``update_weights``), on the
    trainer's node or on the first live rollout node. An eval that fails after its retries costs
    the step its eval numbers, not the run: the step commits with an ``eval_failed`` event. A lost
    trainer node still re-places the step; a lost rollout node is dropped (the eval fails)."""
    cfg = inp.config
    assert inp.dataset.eval_key is not None
    nodes = nodes if nodes is not None else StepNodes(inp.rollout_queues, cfg)
    stub, queue = (nodes.stub(EVALUATE), nodes.live[0]) if nodes.live else (EVALUATE, inp.node_queue)
    try:
        if nodes.spread and not nodes.live:
            raise nodes.none_left(f"evaluate v{version}")
        result = await stub.run(
            EvalInput(
                run_id=inp.run_id, step=inp.step, store_uri=cfg.store, seed=cfg.seed, policy_version=version,
                eval_key=inp.dataset.eval_key, k=cfg.eval.k, temperature=cfg.eval.temperature,
                max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                chunk_size=cfg.rollout.chunk_size, epoch=inp.epoch,
                stop=cfg.rollout.stop, stop_token_ids=cfg.rollout.stop_token_ids,
            ),
            queue=queue,
            summary=f"evaluate v{version}: {inp.dataset.n_eval} held-out prompts, greedy and pass@{cfg.eval.k}",
        )
        return result, []
    except (ActivityError, ApplicationError) as err:
        kind, message = failure_in(err)
        if kind == Failure.NODE_LOST and queue != inp.node_queue:
            nodes.drop(queue, message)
        elif kind == Failure.NODE_LOST:
            raise
        if kind is None:  # not one of ours: the innermost cause says what happened
            cause: BaseException = err
            while cause.__cause__ is not None:
                cause = cause.__cause__
            message = f"{getattr(cause, 'type', None) or type(cause).__name__}: {cause}"
        workflow.logger.warning("eval of step %d failed: %s", inp.step, message)
        return None, [EvalFailed(at=workflow.now().isoformat(), step=inp.step, message=message)]
