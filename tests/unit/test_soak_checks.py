"""The soak's checks (bench/soak_checks.py, bench/soak.py) on stores and events built by
hand: they pass a clean run and catch each way a run can break exactly-once training or
lose a fault, and the fault schedule is a function of the seed."""

from __future__ import annotations

import random
from pathlib import Path

from bench.soak import CELL_FAULTS, KINDS, Fault, fault_checks, plan
from bench.soak_checks import cells_whole, trained_exactly_once
from gpu_runtime.data.datasets import prompts_for_step
from gpu_runtime.store import artifacts as art
from spec.events import CellHealed, CellLost, LighthouseRestarted, LighthouseRestartFailed
from spec.status import DPCellStatus, DPCells
from spec.train import TrainSpec
from spec.trainer_rpc import StepBatch
from workflows.run_state import RunProgress
from workflows.contracts.step import StepSummary

RUN, N_ROWS, SEED, P, G, STEPS = "r", 10, 7, 2, 2, 3
CFG = {"seed": SEED, "data": {"num_train": N_ROWS}, "rollout": {"prompts_per_step": P, "group_size": G}}


def _put(store: Path, key: str, model: object) -> None:
    path = store / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(model.model_dump_json())


def _sample(step: int, prompt: int, group: int) -> art.Sample:
    return art.Sample(sample_id=f"s{step}-p{prompt}-g{group}", prompt_index=prompt, group_index=group, prompt_ids=[1],
                      response_ids=[2], logprobs=[-0.5], weight_version=step - 1, finish_reason="stop")


def write_run(store: Path, samples_of=None) -> RunProgress:
    """A run of STEPS steps as the trainer stores it; ``samples_of(step, default)`` may tamper."""
    steps = []
    for s in range(1, STEPS + 1):
        samples = [_sample(s, i, g) for i in prompts_for_step(N_ROWS, SEED, (s - 1) * P, P) for g in range(G)]
        samples = samples_of(s, samples) if samples_of else samples
        chunk = art.rollout_chunk_key(RUN, s, 0)
        _put(store, chunk, art.RolloutChunk(run_id=RUN, step=s, chunk=0, seed=1, weight_version=s - 1, samples=samples))
        rewards = art.StepRewards(run_id=RUN, step=s, rewards=[
            art.SampleReward(sample_id=x.sample_id, reward=1.0, correct=True) for x in samples])
        _put(store, art.rewards_key(RUN, s), rewards)
        _put(store, art.step_batch_key(RUN, s), StepBatch(
            step=s, policy_version=s - 1, chunk_keys=[chunk], rewards_key=art.rewards_key(RUN, s), group_size=G,
            hparams=TrainSpec(), sft=None))
        steps.append(StepSummary(step=s, policy_version=s, data_cursor=s * P, reward_mean=1, reward_std=0,
                                 accuracy=1, loss=0, step_seconds=1))
    return RunProgress(run_id=RUN, state="completed", step=STEPS, total_steps=STEPS, policy_version=STEPS,
                       data_cursor=STEPS * P, steps=steps)


def test_a_clean_run_passes(tmp_path: Path) -> None:
    assert trained_exactly_once(tmp_path, RUN, CFG, write_run(tmp_path)) == []


def test_a_sample_trained_twice_is_caught(tmp_path: Path) -> None:
    first: list[art.Sample] = []

    def dup(step: int, samples: list[art.Sample]) -> list[art.Sample]:
        if step == 1:
            first.extend(samples)
        return samples + first[:1] if step == 2 else samples

    out = trained_exactly_once(tmp_path, RUN, CFG, write_run(tmp_path, dup))
    assert any("trained in step 1 and step 2" in f for f in out), out
    assert any("not this step's" in f for f in out), out


def test_a_missing_group_and_a_foreign_prompt_are_caught(tmp_path: Path) -> None:
    def tamper(step: int, samples: list[art.Sample]) -> list[art.Sample]:
        if step == 2:
            return samples[:-1]  # a prompt lost a group
        if step == 3:
            x = samples[0]
            other = (x.prompt_index + 1) % N_ROWS
            return [_sample(3, other, x.group_index), *samples[1:]]  # a prompt of no position of this step's
        return samples

    out = trained_exactly_once(tmp_path, RUN, CFG, write_run(tmp_path, tamper))
    assert any(f.startswith("step 2: prompt") and "groups" in f for f in out), out
    assert any(f.startswith("step 3: trained prompts") for f in out), out


def test_skipped_positions_and_a_missing_step_are_caught(tmp_path: Path) -> None:
    p = write_run(tmp_path)
    skipped = p.model_copy(update={"steps": [p.steps[0], p.steps[1].model_copy(update={"data_cursor": 2 * P + 1}),
                                             p.steps[2]]})
    assert any("step 2: trained prompts" in f for f in trained_exactly_once(tmp_path, RUN, CFG, skipped))
    short = p.model_copy(update={"steps": p.steps[:2]})
    out = trained_exactly_once(tmp_path, RUN, CFG, short)
    assert any("committed steps [1, 2]" in f for f in out) and any("data cursor is" in f for f in out), out


def test_cells_must_end_alive_and_equal() -> None:
    def dp(*cells: tuple[str, str]) -> RunProgress:
        return RunProgress(run_id=RUN, state="completed", step=3, total_steps=3, policy_version=3, data_cursor=6,
                           dp=DPCells(node="n", lighthouse_pid=1, cells=[
                               DPCellStatus(index=i, pid=10 + i, state=st, policy_version=3, state_checksum=cs)
                               for i, (st, cs) in enumerate(cells)]))

    assert cells_whole(dp(("alive", "a"), ("alive", "a"))) == []
    assert cells_whole(dp(("alive", "a"), ("lost", "a")))
    assert cells_whole(dp(("alive", "a"), ("alive", "b")))


def test_each_fault_must_show_in_the_events() -> None:
    dead = 2**22 + 12345  # beyond pid_max on this machine: no such process
    faults = [Fault(1, 1, "cell_kill", dead), Fault(2, 3, "cell_stop", dead + 1), Fault(3, 5, "lighthouse_kill", 9)]
    healed = [CellHealed(at="t4", cell=1, held_version=0, copied_version=3, trained_version=4),
              CellHealed(at="t5", cell=1, held_version=0, copied_version=5, trained_version=6)]
    events = [CellLost(at="t1", cell=1, pid=dead, why="died during train_step"),
              CellLost(at="t2", cell=1, pid=dead + 1, why="no answer to train_step within 20 s of its peers "
                                                          "(hung or stopped)"),
              LighthouseRestarted(at="t3", pid=9), *healed]
    assert fault_checks(faults, events) == []
    wrong = [CellLost(at="t2", cell=1, pid=dead + 1, why="died during train_step")]
    assert any("lost for another reason" in f for f in fault_checks(faults, events[:1] + wrong + events[2:]))
    assert any("lighthouse" in f for f in fault_checks(faults, events[:2] + events[3:]))
    assert any("cell heals" in f for f in fault_checks(faults, events[:4]))
    # the first kill is superseded by the second fault on the same cell; the second must heal
    other = [CellHealed(at="t4", cell=0, held_version=0, copied_version=3, trained_version=4)]
    assert fault_checks(faults, events[:3] + other + other) == [
        f"cell_stop of pid {dead + 1} at step 3: its cell never healed afterwards"]
    # a heal before the loss does not count for it
    assert any("never healed" in f for f in fault_checks(faults, healed + events[:3]))


def test_a_kill_of_a_starting_lighthouse_is_answered_by_the_next_restart() -> None:
    """Two kills 1 s apart (soak seed 12, 200 steps): the second hit the lighthouse the
    watchdog was starting; that start failed and the next one answered both kills."""
    kills = [Fault(1, 22, "lighthouse_kill", 9), Fault(2, 23, "lighthouse_kill", 10)]
    heals = [CellHealed(at=f"t{i}", cell=0, held_version=0, copied_version=i, trained_version=i + 1) for i in (5, 6)]
    failed = LighthouseRestartFailed(at="t3", error="torchft lighthouse exited with 247")
    restarted = LighthouseRestarted(at="t4", pid=10)
    assert fault_checks(kills, [failed, restarted, *heals]) == []
    assert fault_checks(kills, [restarted, failed, *heals]) == [
        "2 lighthouse kills, 1 lighthouse_restarted and 1 lighthouse_restart_failed events, the last a failure"]
    assert fault_checks(kills, [restarted, *heals]) == [
        "2 lighthouse kills, 1 lighthouse_restarted and 0 lighthouse_restart_failed events"]


def test_the_schedule_is_the_seeds_and_has_two_early_cell_faults() -> None:
    for seed in range(50):
        a, b = plan(random.Random(seed), 30), plan(random.Random(seed), 30)
        assert a == b and {f.kind for f in a} == set(KINDS) and len(a) == len(KINDS)
        assert sum(f.kind in CELL_FAULTS for f in a[:3]) >= 2
        assert all(0 <= f.delay_s <= 2 and f.gap_steps in (1, 2) and f.target in (0, 1) for f in a)
    assert len(plan(random.Random(0), 200)) == 48
    assert plan(random.Random(1), 30) != plan(random.Random(2), 30)
