"""The recorded workflow histories in tests/histories/: which run made each, under which workflow
id, and the one helper the recording tests call.

The histories are the project's replay baseline (docs/workflow-versioning.md): every one was
recorded by the current workflow code, and ``tests/unit/test_replay_recorded.py`` replays them all
against it, so a change that would break a running workflow fails without a server. They are
refreshed, all together, by running the tests that make them with ``MILESTONE_RECORD_HISTORY=1``:

    MILESTONE_RECORD_HISTORY=1 .venv/bin/python -m pytest -p no:xdist tests/e2e/test_rl_run.py \
        tests/e2e/test_rewards_sampling.py tests/e2e/test_sft_distill.py \
        tests/unit/test_workflows_one_step_off.py tests/unit/test_workflows_fully_async.py \
        tests/e2e/test_rollout_nodes.py tests/e2e/test_multi_host.py
"""

from __future__ import annotations

import os
from pathlib import Path

from temporalio.client import WorkflowHistory

HISTORY_DIR = Path(__file__).resolve().parent / "histories"

# name -> (the workflow id it was recorded under: replay needs it, child ids derive from it; what it is)
RECORDINGS: dict[str, tuple[str, str]] = {
    "training_run": ("e2e-run", "a 3-step sync run with its v0 eval and node liveness watch (e2e test_rl_run)"),
    "rl_step": ("e2e-run/step-1", "its step 1: rollout, reward on the node, train, update weights"),
    "rl_step_eval": ("e2e-run/step-3", "its last step: with its checkpoint and held-out eval"),
    "rl_step_dynamic": ("e2e-dyn/step-2", "a step with dynamic sampling that drew two rounds "
                        "(e2e test_rewards_sampling)"),
    "rl_step_judge": ("e2e-judge/step-1", "a step whose judge reward failed once and was retried on the node "
                      "(e2e test_rewards_sampling)"),
    "training_run_sft": ("sft", "an SFT-mode run with SFTStep children (e2e test_sft_distill)"),
    "sft_step": ("sft/step-2", "its step 2, with its checkpoint"),
    "training_run_one_step_off": ("osf-run", "a 4-step one_step_off run (workflow harness, "
                                  "tests/unit/test_workflows_one_step_off.py)"),
    "rl_step_one_step_off": ("osf-run/step-2", "its step 2: a batch sampled ahead in, the next one out"),
    "training_run_fully_async": ("fa-run", "a 5-step fully_async run, max_staleness 2 (workflow harness, "
                                 "tests/unit/test_workflows_fully_async.py)"),
    "rl_step_fully_async": ("fa-run/step-3", "its step 3: two buffered batches in, step 5's sampled beside "
                            "the train step"),
    "training_run_rollout_nodes": ("spread", "a 3-step run on a trainer node and two rollout nodes "
                                   "(engines.nodes 2; e2e test_rollout_nodes)"),
    "training_run_rollout_node_lost": ("rollout-host-lost", "a run whose rollout host was killed during step 2: "
                                       "replaced by a spare at the boundary, the fence moved (e2e test_multi_host)"),
    "rl_step_rollout_node_lost": ("rollout-host-lost/step-2", "that step: the lost node's chunks dealt again over "
                                  "the survivor"),
}


def recording() -> bool:
    """Whether this test session refreshes the recordings (``MILESTONE_RECORD_HISTORY``)."""
    return bool(os.environ.get("MILESTONE_RECORD_HISTORY"))


def record(name: str, history: WorkflowHistory) -> None:
    """Write ``history`` as recording ``name`` when this session refreshes them; else nothing."""
    if name not in RECORDINGS:
        raise KeyError(f"{name}: not a recording named in tests/recorded_histories.py")
    if history.workflow_id != RECORDINGS[name][0]:
        raise ValueError(f"{name}: recorded under {history.workflow_id}, declared as {RECORDINGS[name][0]}")
    if recording():
        HISTORY_DIR.mkdir(exist_ok=True)
        (HISTORY_DIR / f"{name}.json").write_text(history.to_json())
