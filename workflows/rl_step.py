"""``RLStep``: one RL step as a child workflow (id ``<run-id>/step-<n>``).

sample (``workflows.sampling``: rollout -> reward, in rounds with dynamic sampling; or
the oldest batch sampled ahead by an earlier step) -> train -> update weights ->
checkpoint (every k steps) -> evaluate (every k steps) (``workflows.step_phases``),
then the ``StepSummary`` (``workflows.step_summary``). In one_step_off / fully_async
later steps' batches are sampled during the train step (``workflows.rollout_schedule``).
"""

from __future__ import annotations

import asyncio

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.contracts.sampling import Sampled
    from workflows.contracts.step import RLStepInput, StepSummary
    from workflows.rollout_schedule import buffer_depth, buffered, check_batch, steps_ahead
    from workflows.sampling import sample_step
    from workflows.step_nodes import StepNodes
    from workflows.step_phases import (
        cancelled_on_error,
        checkpoint_if_due,
        evaluate_if_due,
        seconds_since,
        start_cell_restarts,
        train,
        update_weights,
    )
    from workflows.step_summary import StepResults, summarize


@workflow.defn(name="RLStep")
class RLStep:
    @workflow.run
    async def run(self, inp: RLStepInput) -> StepSummary:
        started = workflow.now()
        depth = buffer_depth(inp.config)
        nodes = StepNodes(inp.rollout_queues, inp.config)  # engines.nodes > 0: the run's rollout nodes
        heal = start_cell_restarts(inp)  # lost DP cells start again while the step samples, and join its train step
        async with cancelled_on_error(heal):
            sampled, rest = await take_batch(inp, depth, nodes)
            restarted = await heal if heal is not None else None
        cursor = inp.data_cursor + sampled.prompts
        ahead = start_sampling_ahead(inp, rest, cursor, depth, nodes)
        async with cancelled_on_error(ahead):
            trained = await train(inp, sampled)
            sampled_ahead = await ahead if ahead is not None else []
        synced = await update_weights(inp, trained, nodes)  # after the batches sampled ahead: one version served
        checkpoint = await checkpoint_if_due(inp, cursor)
        evaluated, eval_events = await evaluate_if_due(inp, trained.policy_version, nodes)
        return summarize(StepResults(
            inp=inp, seconds=seconds_since(started), cursor=cursor, sampled=sampled, trained=trained, synced=synced,
            checkpoint=checkpoint, evaluated=evaluated, eval_events=eval_events, restarted=restarted,
            buffered=rest, sampled_ahead=sampled_ahead, lost_rollout_queues=nodes.lost,
        ))


async def take_batch(inp: RLStepInput, depth: int, nodes: StepNodes | None = None) -> tuple[Sampled, list[Sampled]]:
    """The step's batch and the batches still buffered after it: the oldest buffered one
    (sampled during an earlier step), checked, or, with none buffered, one sampled now."""
    buffer = buffered(inp)
    if not buffer:
        return await sample_step(inp, nodes), []
    bad = check_batch(buffer[0], inp, depth)
    if bad is not None:
        raise bad
    return buffer[0], buffer[1:]


def start_sampling_ahead(inp: RLStepInput, rest: list[Sampled], cursor: int, depth: int,
                         nodes: StepNodes | None = None) -> asyncio.Task[list[Sampled]] | None:
    """one_step_off / fully_async: sample later steps' batches during this step's train step,
    on the weights the engines serve now (this step's). Which ones is a function of the step
    number and the depth (``rollout_schedule.steps_ahead``); None: none is due."""
    later = steps_ahead(inp.step, inp.config.steps, len(rest), depth)
    if not later:
        return None
    start = rest[-1].data_cursor + rest[-1].prompts if rest else cursor
    return asyncio.create_task(sample_ahead(inp, later, start, nodes))


async def sample_ahead(inp: RLStepInput, steps: list[int], cursor: int,
                       nodes: StepNodes | None = None) -> list[Sampled]:
    """The batches of ``steps``, one after another on the engines' current weights, each
    drawing its prompts where the one before stopped (dynamic sampling may draw more)."""
    out: list[Sampled] = []
    for step in steps:
        out.append(await sample_step(
            inp.model_copy(update={"step": step, "data_cursor": cursor, "buffer": []}), nodes,
        ))
        cursor = out[-1].data_cursor + out[-1].prompts
    return out
