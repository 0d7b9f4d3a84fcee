"""Replay recorded workflow histories against the current workflow code.

A change to ``TrainingRun``, ``RLStep`` or ``SFTStep`` that would break running
workflows (non-determinism) fails here without any server. Refresh the recordings with
``MILESTONE_RECORD_HISTORY=1 pytest tests/e2e/test_rl_run.py`` (and
test_rewards_sampling.py, test_sft_distill.py) when the change is intended (and
versioned with ``workflow.patched``), keeping the recordings of the older paths.
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer
from temporalio.workflow import NondeterminismError

from workflows.node_watch import LIVENESS_PATCH
from workflows.rl_step import SFT_MODE_PATCH
from workflows.sampling import SAMPLES_PATCH
from workflows.training_run import RUN_WORKFLOWS, SFT_STEP_PATCH

HISTORY_DIR = Path(__file__).resolve().parents[1] / "histories"
HISTORIES = sorted(HISTORY_DIR.glob("*.json"))
# the workflow ids they were recorded under (child ids derive from the parent's id)
# rl_step: a step recorded before the eval existed (replays without it, via the patch);
# rl_step_eval: the last step of a run with its held-out eval; rl_step_dynamic: a step with dynamic
# sampling that drew two rounds (recorded by tests/e2e/test_rewards_sampling.py); rl_step_sft: an
# SFT-mode step with its checkpoint (tests/e2e/test_sft_distill.py);
# training_run_watch: a run with the node liveness watch and placement epochs;
# training_run_one_step_off / rl_step_one_step_off: a 4-step rollout.mode one_step_off run and its
# step 2 (a prefetched batch in, the next one out), recorded on the workflow harness before
# fully_async existed (the buffer of that mode must leave one_step_off's commands unchanged);
# training_run_fully_async / rl_step_fully_async: a 5-step fully_async run (max_staleness 2) and its
# step 3 (two buffered batches in, step 5's sampled beside the train step), on the harness;
# training_run_sft / sft_step: an SFT-mode run with SFTStep children and its step 2 (with its checkpoint,
# tests/e2e/test_sft_distill.py); rl_step_sft stays as recorded: a step of an SFT run started before SFTStep;
# rl_step_on_node / rl_step_dynamic_on_node: steps since the samples-on-node patch (rewards scored on the node,
# a judge reward's retried attempt; dynamic sampling's two rounds trained as a selection, no assemble_batch),
# recorded by tests/e2e/test_rewards_sampling.py; every other rl_step* scored on the control worker
WORKFLOW_IDS = {
    "training_run": "e2e-run", "rl_step": "e2e-run/step-1", "rl_step_eval": "e2e-run/step-3",
    "rl_step_dynamic": "e2e-dyn/step-2", "rl_step_sft": "sft/step-2", "training_run_watch": "e2e-run",
    "training_run_one_step_off": "osf-run", "rl_step_one_step_off": "osf-run/step-2",
    "training_run_fully_async": "fa-run", "rl_step_fully_async": "fa-run/step-3",
    "training_run_sft": "sft", "sft_step": "sft/step-2",
    "rl_step_on_node": "e2e-judge/step-1", "rl_step_dynamic_on_node": "e2e-dyn/step-2",
}


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
def test_recorded_history_replays(path: Path) -> None:
    history = WorkflowHistory.from_json(WORKFLOW_IDS[path.stem], path.read_text())
    replayer = Replayer(workflows=RUN_WORKFLOWS, data_converter=pydantic_data_converter)
    asyncio.run(replayer.replay_workflow(history))


def test_recordings_exist() -> None:
    assert {p.stem for p in HISTORIES} >= {
        "training_run", "rl_step", "rl_step_eval", "rl_step_dynamic", "rl_step_sft", "training_run_watch",
        "training_run_one_step_off", "rl_step_one_step_off", "training_run_fully_async", "rl_step_fully_async",
        "training_run_sft", "sft_step", "rl_step_on_node", "rl_step_dynamic_on_node",
    }


def _with_eval_due(history_json: str) -> str:
    """The pre-eval step-1 history with an input on which the eval is due (every step,
    a held-out split): what a step recorded before the change would look like to new code."""
    doc = json.loads(history_json)
    payload = doc["events"][0]["workflowExecutionStartedEventAttributes"]["input"]["payloads"][0]
    inp = json.loads(base64.b64decode(payload["data"]))
    inp["config"]["eval"] = {"every": 1}
    inp["dataset"].update(eval_key="runs/e2e-run/data/eval.jsonl", n_eval=8)
    payload["data"] = base64.b64encode(json.dumps(inp).encode()).decode()
    return json.dumps(doc)


def test_step_recorded_before_the_eval_replays_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``eval-activity`` patch is what keeps it deterministic: forced on, replay fails."""
    history = WorkflowHistory.from_json("e2e-run/step-1", _with_eval_due((HISTORY_DIR / "rl_step.json").read_text()))
    replayer = Replayer(workflows=RUN_WORKFLOWS, data_converter=pydantic_data_converter)
    asyncio.run(replayer.replay_workflow(history))
    monkeypatch.setattr(workflow, "patched", lambda patch_id: True)
    with pytest.raises(NondeterminismError):
        asyncio.run(replayer.replay_workflow(history))


@pytest.mark.parametrize(("stem", "patch_id", "forced"), [
    ("training_run", LIVENESS_PATCH, True), ("training_run_watch", LIVENESS_PATCH, False),
    ("rl_step_on_node", SAMPLES_PATCH, False), ("rl_step_dynamic_on_node", SAMPLES_PATCH, False),
    ("rl_step", SAMPLES_PATCH, True), ("rl_step_dynamic", SAMPLES_PATCH, True),
])
def test_a_patch_keeps_both_kinds_of_recording_replaying(monkeypatch: pytest.MonkeyPatch, stem: str, patch_id: str,
                                                          forced: bool) -> None:
    """A recording from before a patch replays without it, one from since with it; forcing the
    patch either way breaks the recording of the other kind. ``node-liveness``: a run without /
    with the node liveness watch. ``samples-on-node``: a step scoring on the control worker (and,
    with dynamic sampling, assembling a batch/ copy) / on its node (training a selection)."""
    history = WorkflowHistory.from_json(WORKFLOW_IDS[stem], (HISTORY_DIR / f"{stem}.json").read_text())
    replayer = Replayer(workflows=RUN_WORKFLOWS, data_converter=pydantic_data_converter)
    real = workflow.patched
    monkeypatch.setattr(workflow, "patched", lambda pid: forced if pid == patch_id else real(pid))
    with pytest.raises(NondeterminismError):
        asyncio.run(replayer.replay_workflow(history))


@pytest.mark.parametrize(("stem", "patch_id"), [("training_run_sft", SFT_STEP_PATCH), ("rl_step_sft", SFT_MODE_PATCH)])
def test_sft_runs_replay_their_step_children_only_with_their_patch(monkeypatch: pytest.MonkeyPatch, stem: str,
                                                                   patch_id: str) -> None:
    """An SFT run started before SFTStep made RLStep children, whose mode-sft path runs the
    SFT phases; one started since makes SFTStep children. Without its patch either recording
    fails to replay."""
    history = WorkflowHistory.from_json(WORKFLOW_IDS[stem], (HISTORY_DIR / f"{stem}.json").read_text())
    replayer = Replayer(workflows=RUN_WORKFLOWS, data_converter=pydantic_data_converter)
    real = workflow.patched
    monkeypatch.setattr(workflow, "patched", lambda pid: pid != patch_id and real(pid))
    with pytest.raises(NondeterminismError):
        asyncio.run(replayer.replay_workflow(history))
