"""``SFTStep``: one SFT step (mode sft) as a child workflow (id ``<run-id>/step-<n>``).

train_step on ``sft.batch_size`` dataset rows (their labels: no rollout, no reward)
-> update_weights -> checkpoint (every k steps) -> evaluate (every k steps).
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from spec.trainer_rpc import SFTRows
    from workflows.contracts.step import RLStepInput, StepSummary
    from workflows.step_phases import (
        checkpoint_if_due,
        evaluate_if_due,
        restart_cells,
        seconds_since,
        train,
        update_weights,
    )
    from workflows.step_summary import StepResults, summarize


@workflow.defn(name="SFTStep")
class SFTStep:
    @workflow.run
    async def run(self, inp: RLStepInput) -> StepSummary:
        started = workflow.now()
        rows = SFTRows(data_cursor=inp.data_cursor, n_rows=inp.config.sft.batch_size)
        restarted = await restart_cells(inp) if inp.restart_cells else None  # lost DP cells rejoin for the train step
        trained = await train(inp, None, sft_rows=rows)
        synced = await update_weights(inp, trained)
        cursor = inp.data_cursor + rows.n_rows
        checkpoint = await checkpoint_if_due(inp, cursor)
        evaluated, eval_events = await evaluate_if_due(inp, trained.policy_version)
        return summarize(StepResults(
            inp=inp, seconds=seconds_since(started), cursor=cursor, trained=trained, synced=synced,
            checkpoint=checkpoint, evaluated=evaluated, eval_events=eval_events, restarted=restarted,
        ))
