"""Replay recorded workflow histories against the current workflow code.

A change to ``TrainingRun`` or ``RLStep`` that would break running workflows
(non-determinism) fails here without any server. Refresh the recordings with
``MILESTONE_RECORD_HISTORY=1 pytest tests/e2e/test_rl_run.py`` when the change is
intended (and versioned with ``workflow.patched``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.rl_step import RLStep
from workflows.training_run import TrainingRun

HISTORIES = sorted((Path(__file__).resolve().parents[1] / "histories").glob("*.json"))
# the workflow ids they were recorded under (child ids derive from the parent's id)
# rl_step: a step recorded before the eval existed (replays without it, via the patch);
# rl_step_eval: the last step of a run with its held-out eval
WORKFLOW_IDS = {"training_run": "e2e-run", "rl_step": "e2e-run/step-1", "rl_step_eval": "e2e-run/step-3"}


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
def test_recorded_history_replays(path: Path) -> None:
    history = WorkflowHistory.from_json(WORKFLOW_IDS[path.stem], path.read_text())
    replayer = Replayer(workflows=[TrainingRun, RLStep], data_converter=pydantic_data_converter)
    asyncio.run(replayer.replay_workflow(history))


def test_recordings_exist() -> None:
    assert {p.stem for p in HISTORIES} >= {"training_run", "rl_step"}
