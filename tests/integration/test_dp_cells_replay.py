"""trainer.cells: 2 through ``TrainerService`` (what the node's trainer process runs): a
shrink step, then a trainer crash. The successor restores the checkpoint and replays the
stored steps, each split the way it committed (the train result records ``dp_cells``), so
the rebuilt state is bitwise the crashed trainer's, shrink step included. Replaying the
shrink step over two cells instead would differ (checked: the split is what makes it exact).

Rollouts run in-process (``bench._inproc.store_rollout``: the real chunk plan and seeds,
``generate_batch`` where a run asks an engine) on each version's published weights.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torchft  # noqa: F401  (a dev dependency: imported, so a broken install fails loudly)

from bench._inproc import dataset_rows, run_setup, step_batch, store_rollout
from gpu_runtime.data.rewards import score_samples
from gpu_runtime.proc.processes import pid_alive
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.object_store import LocalStore
from gpu_runtime.trainer.dp.group import DPGroup
from gpu_runtime.trainer.service import TrainerService
from spec.run import RunConfig
from spec.trainer_rpc import RunSetup, VersionInfo
from tests.stack import tiny_config, wait_for

RUN = "dp-replay"
STEPS = 3


def _log_has(svc: TrainerService, text: str) -> bool:
    p = svc.work_dir / RUN / "dp" / "cell1.log"
    return p.exists() and text in p.read_text(errors="replace")


def test_replay_after_a_shrink_step_is_bitwise(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MILESTONE_FAULT_CELL_DELAY", "1:1.5")  # cell 1 waits before each allreduce: a kill lands there
    cfg = RunConfig.model_validate(tiny_config(
        tmp_path / "store", steps=STEPS, sft={"steps": 10}, train={"lr": 1e-3, "micro_batch_size": 4, "entropy_coef": 0.01},
        checkpoint={"every": 100, "keep_last": 5}, trainer={"cells": 2}))
    setup = run_setup(cfg, RUN)
    store = LocalStore(tmp_path / "store")
    rows = dataset_rows(cfg, tmp_path / "train.jsonl")
    store.put_file(setup.dataset_key, tmp_path / "train.jsonl")
    first = TrainerService(tmp_path / "first")
    try:
        v0 = first.ensure_version(setup, 0)  # SFT -> v0, the only checkpoint
        folder = Path(v0.model_path)
        cells, checksum, kinds = [], "", [e.kind for e in v0.events]
        for step in range(1, STEPS + 1):
            if step == 3:
                restarted = first.restart_cells(setup, [1])
                assert restarted.outcome == {"1": "restarting"}
                kinds += [e.kind for e in restarted.events]
                group = first.layouts.dp_group
                assert group is not None
                wait_for(lambda group=group: group.members[1].state == "alive", 120, what="cell 1 restarted")
            keys, rkey = _store_step_samples(store, cfg, folder, rows, step)
            killer = _kill_cell_1_in_v2(first) if step == 2 else None
            res = first.train_step(setup, step_batch(cfg, RUN, step, keys, rkey))
            if killer is not None:
                killer.join()
            cells.append(int(res.metrics["dp_cells"]))
            assert res.metrics["grad_norm"] > 0  # the entropy bonus: a gradient even when every reward is equal
            kinds += [e.kind for e in res.events]
            checksum = res.checksum
            folder = first._weights_dir(res.policy_version)
        assert cells == [2, 1, 2]  # step 2 committed by cell 0 alone, cell 1 healed into step 3
        assert {"cells_started", "cell_lost", "cell_restarted", "cell_healed"} <= set(kinds), kinds
        pids = [c.pid for c in first.layouts.dp_group.members] if first.layouts.dp_group else []
    finally:
        first.close()  # the crash: every cell and the lighthouse gone
    assert not any(pid_alive(p) for p in pids if p)

    info = _rebuilt(tmp_path / "second", setup)
    assert info.rebuild is not None and info.rebuild.restored_from_step == 0
    assert info.rebuild.replayed_steps == [1, 2, 3]
    assert info.checksum == checksum  # bitwise, the shrink step included

    # the split is what makes it exact: step 2 replayed over both cells is a different float sum
    monkeypatch.setattr(DPGroup, "committed_cells", staticmethod(lambda metrics: None))
    assert _rebuilt(tmp_path / "third", setup).checksum != checksum


def _store_step_samples(store: LocalStore, cfg: RunConfig, folder: Path, rows: list[dict],
                        step: int) -> tuple[list[str], str]:
    """Generate the step's rollout with the weights in ``folder``, score it, store both:
    the chunk keys and the rewards key, as the node agent would leave them."""
    keys, samples = store_rollout(store, cfg, RUN, step, folder, rows)
    rkey = art.rewards_key(RUN, step)
    rewards = score_samples(samples, dict(enumerate(rows)), cfg.reward)
    art.put_model(store, rkey, art.StepRewards(run_id=RUN, step=step, rewards=rewards))
    return keys, rkey


def _kill_cell_1_in_v2(service: TrainerService) -> threading.Thread:
    """A thread that SIGKILLs cell 1 while it waits before the allreduce of v2 (started)."""
    assert service.layouts.dp_group is not None
    victim = service.layouts.dp_group.members[1].pid
    assert victim is not None

    def kill() -> None:
        wait_for(lambda: _log_has(service, "fault delay before the allreduce of v2"), 60, what="cell 1 in v2")
        os.kill(victim, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    return killer


def _rebuilt(work_dir: Path, setup: RunSetup) -> VersionInfo:
    """A fresh trainer's ``ensure_version`` of the last step (restore and replay), closed after."""
    service = TrainerService(work_dir)
    try:
        return service.ensure_version(setup, STEPS)
    finally:
        service.close()
