"""``rollout.mode: one_step_off`` in real runs: step n+1's batch is generated during step
n's train_step, one policy version behind, and faults in either overlapping half heal to
the bitwise result of the fault-free one_step_off run, every prompt trained once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.faults import (
    assert_bitwise_equal, assert_trained_exactly_once, final_weights, kill_engines, kill_trainer,
    module_baseline_fixture, module_stack_fixtures, run_progress, run_with_fault,
)
from tests.stack import Stack, tiny_config
from workflows.stubs import ROLLOUT, TRAIN_STEP

pytestmark = pytest.mark.e2e
STEPS = 3
# checkpoints only at the end (a rebuilt trainer restores step 0 and replays), as test_process_faults' CFG
CFG = {"steps": STEPS, "checkpoint": {"every": 3, "keep_last": 2}, "rollout": {"mode": "one_step_off"}}
# fault-injection aids: each train step waits 2 s first and each decoded token 300 ms, so a
# kill lands inside the half it aims at while the other half runs beside it
ENV = {"MILESTONE_FAULT_TRAIN_DELAY_S": "2", "MILESTONE_ENGINE_STEP_DELAY_MS": "300"}
VERSIONS = [{0}, {0}, {1}]  # the weights each step's samples were generated on, one version behind


def cfg(store: Path) -> dict:
    c = tiny_config(store, **CFG)
    c["rollout"] = {**tiny_config(store)["rollout"], "mode": "one_step_off"}
    return c


stack, store = module_stack_fixtures("one-step-off", ENV)
baseline = module_baseline_fixture(cfg)


def test_fault_free_run_samples_one_version_behind(stack: Stack, store: Path, baseline: dict) -> None:
    p = run_progress(stack, "baseline")
    assert [s.rollout_version for s in p.steps] == [0, 0, 1]
    assert all(s.overlap_seconds > 0 for s in p.steps[:-1]) and p.steps[-1].overlap_seconds == 0
    assert p.state == "completed" and p.policy_version == STEPS
    # what the engines stamped on each sample, not only what the workflow says
    assert_trained_exactly_once(store, "baseline", cfg(store), VERSIONS)


def test_engine_killed_during_the_overlapped_rollout(stack: Stack, store: Path, baseline: dict) -> None:
    run_id = "osf-engine-kill"
    # step 3's batch is generated inside step 2's workflow, beside step 2's train_step
    summary, p, _ = run_with_fault(stack, run_id, cfg(store), (2, ROLLOUT), lambda s: kill_engines(s, [0]))
    assert summary.steps == STEPS and summary.policy_version == STEPS
    kinds = [e.kind for e in p.events]
    assert "engine_dead" in kinds and "engine_recovered" in kinds, kinds
    assert [s.rollout_version for s in p.steps] == [0, 0, 1]
    assert_trained_exactly_once(store, run_id, cfg(store), VERSIONS)
    assert_bitwise_equal(final_weights(store, run_id, STEPS), baseline)


def test_trainer_killed_while_the_next_batch_generates(stack: Stack, store: Path, baseline: dict) -> None:
    run_id = "osf-trainer-kill"
    _, p, old = run_with_fault(stack, run_id, cfg(store), (2, TRAIN_STEP), kill_trainer)
    assert p.steps[1].restored_from_step == 0 and p.steps[1].replayed_steps == [1]
    assert stack.node_pids("node0")["trainer"] != old
    assert [s.rollout_version for s in p.steps] == [0, 0, 1]
    assert_trained_exactly_once(store, run_id, cfg(store))
    assert_bitwise_equal(final_weights(store, run_id, STEPS), baseline)
