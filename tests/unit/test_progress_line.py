"""``milestone status``'s progress line (``milestone_cli.progress_view.format_progress``)."""

from __future__ import annotations
from datetime import UTC


def test_the_progress_line_shows_staleness_and_overlap() -> None:
    from milestone_cli.progress_view import format_progress
    from workflows.run_state import RunProgress
    from workflows.contracts.step import StepSummary

    def line(**kw: object) -> str:
        step = StepSummary(step=3, policy_version=3, data_cursor=12, reward_mean=0.5, reward_std=0.1, accuracy=0.5,
                           loss=0.1, step_seconds=1.0, **kw)
        return format_progress(RunProgress(run_id="r", state="running", step=3, total_steps=4, policy_version=3,
                                           data_cursor=12, steps=[step]))

    assert line(rollout_version=1, overlap_seconds=0.75, buffer_depth=1).endswith(
        "| samples v1 (staleness 1), 1 ahead, 0.8s overlapped")
    # fully_async, buffer full, the last steps: nothing sampled beside this train step
    assert line(rollout_version=0, buffer_depth=2).endswith("| samples v0 (staleness 2), 2 ahead, 0.0s overlapped")
    assert "staleness" not in line(rollout_version=2)  # sync: the batch of the version before, nothing overlapped


def test_the_progress_line_of_an_sft_run_shows_its_loss_not_a_reward() -> None:
    from milestone_cli.progress_view import format_progress
    from workflows.run_state import RunProgress
    from workflows.contracts.step import StepSummary

    step = StepSummary(step=2, policy_version=2, data_cursor=64, reward_mean=0.0, reward_std=0.0, accuracy=0.0,
                       loss=1.2345, step_seconds=0.5)
    p = RunProgress(run_id="r", state="running", step=2, total_steps=4, policy_version=2, data_cursor=64,
                    steps=[step], mode="sft")
    assert format_progress(p).endswith("| sft loss 1.2345 | 0.5s/step")
    assert "reward" not in format_progress(p)


def test_status_lists_the_cell_and_its_ranks() -> None:
    """A fsdp2 run's cell as the trainer reported it (train_step result -> TrainingRun state ->
    progress): one line per cell, one per rank with pid, Ray node and state."""
    from activities import translate
    from milestone_cli.progress_view import format_cells
    from spec.status import CellInfo, CellRankInfo
    from spec.trainer_rpc import TrainResult
    from workflows.run_state import RunProgress

    cell = CellInfo(generation=2, placement="strict_pack", ray_address="local", ranks=[
        CellRankInfo(rank=r, pid=100 + r, node_ip="127.0.0.1", node_id=f"n{r}", state="alive") for r in range(2)])
    res = TrainResult(policy_version=3, checksum="c", metrics={}, seconds=1.0, cell=cell)
    out = translate.train_step_result(res, [], "node0")
    assert out.cell is not None and out.cell.node == "node0" and [r.pid for r in out.cell.ranks] == [100, 101]
    assert translate.train_step_result(res.model_copy(update={"cell": None}), []).cell is None  # backend single
    p = RunProgress(run_id="r", state="running", step=3, total_steps=4, policy_version=3, data_cursor=0,
                    cells=[out.cell])
    assert format_cells(p) == [
        "  cell 2 on node0: 2 ranks, strict_pack, ray local",
        "    rank 0: pid 100 node 127.0.0.1 alive",
        "    rank 1: pid 101 node 127.0.0.1 alive",
    ]
    assert RunProgress.model_validate_json(p.model_dump_json()).cells[0].ranks[1].pid == 101  # the --json shape


def test_status_lists_the_dp_cells_and_when_a_lost_one_restarts() -> None:
    """trainer.cells: the DP cells as the trainer reported them (train_step result -> progress),
    with the run's restart schedule for the lost one, and the shrink step on the progress line."""
    from datetime import datetime

    from activities import translate
    from milestone_cli.progress_view import format_cells, format_progress
    from spec.status import DPCellStatus, DPCells
    from spec.trainer_rpc import TrainResult
    from workflows.contracts.cells import CellHeal
    from workflows.run_state import RunProgress
    from workflows.contracts.step import StepSummary

    dp = DPCells(lighthouse_pid=7, cells=[
        DPCellStatus(index=0, pid=100, state="alive", policy_version=3, state_checksum="abc"),
        DPCellStatus(index=1, pid=101, state="lost", why="died during train_step", policy_version=2)])
    out = translate.train_step_result(TrainResult(policy_version=3, checksum="c",
                                                  metrics={"dp_cells": 1.0}, seconds=1.0, dp=dp), [], "node0")
    assert out.dp is not None and out.dp.node == "node0" and [c.state for c in out.dp.cells] == ["alive", "lost"]
    due = datetime(2026, 12, 1, 12, 0, 5, tzinfo=UTC).timestamp()
    step = StepSummary(step=3, policy_version=3, data_cursor=12, reward_mean=0.5, reward_std=0.1, accuracy=0.5,
                       loss=0.1, step_seconds=1.0, dp_cells=1)
    p = RunProgress(run_id="r", state="running", step=3, total_steps=4, policy_version=3, data_cursor=12,
                    steps=[step], dp=out.dp, cell_heal={"1": CellHeal(lost_at="t", due_at=due, failures=1)})
    assert format_cells(p) == [
        "  DP cells on node0: 1/2 alive, torchft lighthouse pid 7",
        "    cell 0: pid 100 alive v3",
        "    cell 1: pid 101 lost v2: died during train_step; restart due 2026-12-01T12:00:05+00:00 (failed restarts: 1)",
    ]
    assert format_progress(p).endswith("| 1/2 DP cells")
    assert RunProgress.model_validate_json(p.model_dump_json()).cell_heal["1"].failures == 1  # the --json shape
