"""``rollout.mode: fully_async`` (``max_staleness: 2``) in real runs: step 1 fills a buffer
of two batches on v0, each later step trains the oldest and samples one more beside its
train_step. The control worker killed mid-run and the Temporal server restarted mid-run
(both while a batch for a later step generates beside a train step) each end bitwise
equal to the fault-free fully_async run, every prompt trained once (asserted by the
prompt ids stored with each trained sample): the schedule is replayed from history,
never re-raced. A fork at step 2 (two batches buffered) without change carries the
parent's buffer and ends bitwise equal to it, and so does a ``--resume-from`` of a
run's step-2 checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.e2e.faults import (
    assert_bitwise_equal, assert_trained_exactly_once, final_weights, module_baseline_fixture, module_stack_fixtures,
    restart_control, restart_server, run_progress, run_with_fault, trained_samples,
)
from tests.e2e.test_fork import cli
from tests.stack import Stack, tiny_config
from workflows.run_state import RunProgress
from workflows.stubs import ROLLOUT

pytestmark = pytest.mark.e2e
STEPS, K = 4, 2
# checkpoint at the end only; every batch is sampled on v0 (steps 1-3) or v1 (step 4)
CFG = {"steps": STEPS, "checkpoint": {"every": STEPS, "keep_last": 2},
       "rollout": {"mode": "fully_async", "max_staleness": K}}
# fault-injection aids: each train step waits 2 s first and each decoded token 300 ms, so a
# fault lands while a train step and the rollout of a later step's batch run side by side
ENV = {"MILESTONE_FAULT_TRAIN_DELAY_S": "2", "MILESTONE_ENGINE_STEP_DELAY_MS": "300"}
VERSIONS = [{0}, {0}, {0}, {1}]  # the weights each step's samples were generated on
STALENESS = [0, 1, 2, 2]


def cfg(store: Path) -> dict:
    return tiny_config(store, **CFG)


stack, store = module_stack_fixtures("fully-async", ENV)
baseline = module_baseline_fixture(cfg)


def assert_schedule_and_exactly_once(store: Path, run_id: str) -> None:
    """Each step trained exactly its prompts (seed, cursor), each once, in order, on
    samples the engines stamped with the version the schedule says."""
    assert_trained_exactly_once(store, run_id, cfg(store), VERSIONS)


def assert_progress(p: RunProgress) -> None:
    assert p.state == "completed" and p.policy_version == STEPS
    assert [s.staleness for s in p.steps] == STALENESS
    assert [s.buffer_depth for s in p.steps] == [2, 2, 1, 0]


def assert_continued_after_step_2(p: RunProgress) -> None:
    """A run that took over the schedule after step 2 (a fork, a resume): steps 3 and 4 only,
    at the staleness the uninterrupted run had."""
    assert [s.step for s in p.steps] == [3, 4] and p.policy_version == STEPS
    assert [s.staleness for s in p.steps] == STALENESS[2:]


def test_fault_free_run_keeps_two_batches_ahead(stack: Stack, store: Path, baseline: dict) -> None:
    p = run_progress(stack, "baseline")
    assert_progress(p)
    # steps 1 and 2 sample later batches beside their train step; 3 and 4 find them buffered
    assert [s.overlap_seconds > 0 for s in p.steps] == [True, True, False, False]
    assert_schedule_and_exactly_once(store, "baseline")


def test_control_worker_killed_while_a_later_batch_generates(stack: Stack, store: Path, baseline: dict) -> None:
    run_id = "fa-control-crash"
    # step 4's batch is generated inside step 2's workflow, beside step 2's train_step
    summary, p, _ = run_with_fault(stack, run_id, cfg(store), (2, ROLLOUT), restart_control)
    assert summary.steps == STEPS and summary.data_cursor == STEPS * 4
    assert_progress(p)
    assert_schedule_and_exactly_once(store, run_id)
    assert_bitwise_equal(final_weights(store, run_id, STEPS), baseline)


def test_temporal_server_restarted_while_a_later_batch_generates(stack: Stack, store: Path, baseline: dict) -> None:
    run_id = "fa-server-restart"
    summary, p, _ = run_with_fault(stack, run_id, cfg(store), (2, ROLLOUT), restart_server)
    assert summary.steps == STEPS
    assert_progress(p)
    assert_schedule_and_exactly_once(store, run_id)
    assert_bitwise_equal(final_weights(store, run_id, STEPS), baseline)


def test_fork_mid_buffer_without_change_equals_the_parent(stack: Stack, store: Path, baseline: dict) -> None:
    out = cli(stack, "fork", "baseline", "--from-step", "2", "--run-id", "fa-fork", "--wait")
    assert out.returncode == 0, out.stderr
    assert "fully_async: carries 2 batch(es) baseline sampled ahead after step 2" in out.stdout, out.stdout

    assert_continued_after_step_2(run_progress(stack, "fa-fork"))
    for step in (3, 4):  # the parent's batches, trained once each, by the fork
        assert trained_samples(store, "fa-fork", step) == trained_samples(store, "baseline", step)
    assert_bitwise_equal(final_weights(store, "fa-fork", STEPS), baseline)


def test_resume_mid_buffer_carries_the_buffer_and_equals_the_baseline(stack: Stack, store: Path, baseline: dict,
                                                                        tmp_path: Path) -> None:
    """``--resume-from`` a checkpoint taken with two batches buffered: the resumed run trains
    the batches its previous execution had sampled ahead (read from that step's workflow in
    Temporal), as the uninterrupted run did, instead of sampling them afresh on newer weights."""
    config = tmp_path / "fa.yaml"
    config.write_text(yaml.safe_dump(tiny_config(store, **{**CFG, "checkpoint": {"every": 2, "keep_last": 3}})))
    out = cli(stack, "start", str(config), "--run-id", "fa-resume", "--wait")
    assert out.returncode == 0, out.stderr
    first = {step: trained_samples(store, "fa-resume", step) for step in (3, 4)}
    out = cli(stack, "start", str(config), "--resume-from", f"file://{store}/runs/fa-resume/checkpoints/step-000002",
              "--wait")
    assert out.returncode == 0, out.stderr
    assert "resuming fa-resume at step 3" in out.stdout
    assert "fully_async: carries 2 batch(es) fa-resume sampled ahead after step 2" in out.stdout, out.stdout

    assert_continued_after_step_2(run_progress(stack, "fa-resume"))
    for step in (3, 4):  # the batches sampled before the checkpoint, on v0, as the baseline trained them
        assert trained_samples(store, "fa-resume", step) == first[step] == trained_samples(store, "baseline", step)
    assert_schedule_and_exactly_once(store, "fa-resume")
    assert_bitwise_equal(final_weights(store, "fa-resume", STEPS), baseline)
