"""What the trainer writes where, per step (issue 23), through ``TrainerService`` (what the
node's trainer process runs) on a file:// store:

- a step without a checkpoint puts no weights in the store (only its records); a checkpoint
  step's version folder goes up with its checkpoint, in the background, and the store keeps
  v0 and the durable checkpoints' versions only (``checkpoint.keep_last``);
- a checkpoint is a snapshot: the trainer trains on while it is written, and what lands in
  the store is the state at the checkpoint's step, bitwise (restored by a fresh trainer,
  weights and AdamW state alike);
- a version with no stored copy is rebuilt by a fresh trainer (checkpoint + replay), bitwise;
- the node keeps no local checkpoint once it is durable.

Rollouts run in-process (``bench._inproc.store_rollout``) on each version's exported folder.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from bench._inproc import dataset_rows, run_setup, step_batch, store_rollout
from gpu_runtime.data.rewards import score_samples
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.object_store import LocalStore
from gpu_runtime.trainer.service import TrainerService
from spec.events import DiskFull
from spec.run import RunConfig
from spec.trainer_rpc import RunSetup
from tests.stack import tiny_config

RUN = "ckpt-run"
STEPS = 5


def _train(svc: TrainerService, setup: RunSetup, cfg: RunConfig, store: LocalStore, rows: list[dict],
           step: int, folder: Path) -> str:
    keys, samples = store_rollout(store, cfg, RUN, step, folder, rows)
    rewards = score_samples(samples, dict(enumerate(rows)), cfg.reward)
    rkey = art.rewards_key(RUN, step)
    art.put_model(store, rkey, art.StepRewards(run_id=RUN, step=step, rewards=rewards))
    return svc.train_step(setup, step_batch(cfg, RUN, step, keys, rkey)).checksum


def _optimizer_state(svc: TrainerService) -> dict[str, torch.Tensor]:
    assert svc.trainer is not None
    state = svc.trainer.optimizer.state_dict()["state"]
    return {f"{i}.{n}": t for i in state for n, t in state[i].items() if isinstance(t, torch.Tensor)}


def _stored_versions(store_dir: Path) -> list[str]:
    weights = store_dir / "runs" / RUN / "weights"
    return sorted(d.name for d in weights.iterdir() if (d / "model.safetensors").exists())


@pytest.fixture
def run(tmp_path: Path) -> tuple[RunConfig, RunSetup, LocalStore, list[dict]]:
    cfg = RunConfig.model_validate(tiny_config(
        tmp_path / "store", steps=STEPS, sft={"steps": 5}, train={"lr": 1e-3, "entropy_coef": 0.01},
        checkpoint={"every": 2, "keep_last": 2}))
    setup = run_setup(cfg, RUN)
    store = LocalStore(tmp_path / "store")
    rows = dataset_rows(cfg, tmp_path / "train.jsonl")
    store.put_file(setup.dataset_key, tmp_path / "train.jsonl")
    return cfg, setup, store, rows


def test_weights_reach_the_store_only_with_checkpoints_and_restore_bitwise(
        tmp_path: Path, run: tuple[RunConfig, RunSetup, LocalStore, list[dict]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg, setup, store, rows = run
    gate = tmp_path / "write-now"  # the background writes wait for it: step 5 trains before checkpoint 4 is written
    monkeypatch.setenv("MILESTONE_FAULT_UPLOAD_GATE", str(gate))
    gate.touch()  # open for checkpoint 0 (SFT)
    svc = TrainerService(tmp_path / "node")
    folder = Path(svc.ensure_version(setup, 0).model_path)
    checksums: dict[int, str] = {}
    at_checkpoint: dict[str, torch.Tensor] = {}
    for step in range(1, STEPS + 1):
        checksums[step] = _train(svc, setup, cfg, store, rows, step, folder)
        folder = svc._weights_dir(step)
        if step == 1:  # a step without a checkpoint: no weights in the store beyond v0's
            assert _stored_versions(tmp_path / "store") == ["v000000"]
        if step == 4:
            at_checkpoint = {k: t.clone() for k, t in _optimizer_state(svc).items()}
            gate.unlink()
        if step == STEPS:
            assert svc.ckpts is not None and not svc.ckpts.wait_for_uploads(0)  # checkpoint 4: not written yet
            gate.touch()
        if step % 2 == 0 or step == STEPS:  # the run's last checkpoint is durable before it ends
            svc.save_checkpoint(step, data_cursor=step * cfg.rollout.prompts_per_step, sync=step == STEPS)
    # v0 and the durable checkpoints' versions (keep_last 2: v2 went with checkpoint 2)
    assert _stored_versions(tmp_path / "store") == ["v000000", "v000004", "v000005"]
    ckpts = tmp_path / "store" / "runs" / RUN / "checkpoints"
    assert sorted(d.parent.name for d in ckpts.glob("*/manifest.json")) == ["step-000004", "step-000005"]
    assert not list((tmp_path / "node" / RUN / "checkpoints").glob("step-*"))  # durable: no local copy left

    # step 4's checkpoint holds step 4's state although the trainer trained step 5 meanwhile
    fresh = TrainerService(tmp_path / "fresh")
    info = fresh.ensure_version(setup, 4)
    assert info.rebuild is not None and info.rebuild.restored_from_step == 4 and info.rebuild.replayed_steps == []
    assert info.checksum == checksums[4]
    restored = _optimizer_state(fresh)
    assert restored.keys() == at_checkpoint.keys()
    assert all(torch.equal(restored[k], at_checkpoint[k]) for k in at_checkpoint)
    # version 3 has no stored copy and no checkpoint at or below it: SFT from the seed + replay
    info = TrainerService(tmp_path / "again").ensure_version(setup, 3)
    assert info.rebuild is not None and info.rebuild.restored_from_step is None
    assert info.rebuild.replayed_steps == [1, 2, 3] and info.checksum == checksums[3]


def test_a_version_the_config_keeps_stays_in_the_store(tmp_path: Path) -> None:
    """``checkpoint.keep_versions``: v2's model folder outlives checkpoint 2 (keep_last 2 prunes it)."""
    cfg = RunConfig.model_validate(tiny_config(
        tmp_path / "store", steps=STEPS, sft={"steps": 5}, train={"lr": 1e-3, "entropy_coef": 0.01},
        checkpoint={"every": 2, "keep_last": 2, "keep_versions": [2]}))
    setup = run_setup(cfg, RUN)
    assert setup.keep_versions == [2]
    store = LocalStore(tmp_path / "store")
    rows = dataset_rows(cfg, tmp_path / "train.jsonl")
    store.put_file(setup.dataset_key, tmp_path / "train.jsonl")
    svc = TrainerService(tmp_path / "node")
    folder = Path(svc.ensure_version(setup, 0).model_path)
    for step in range(1, STEPS + 1):
        _train(svc, setup, cfg, store, rows, step, folder)
        folder = svc._weights_dir(step)
        if step % 2 == 0 or step == STEPS:
            svc.save_checkpoint(step, data_cursor=step * cfg.rollout.prompts_per_step, sync=True)
    assert _stored_versions(tmp_path / "store") == ["v000000", "v000002", "v000004", "v000005"]
    ckpts = tmp_path / "store" / "runs" / RUN / "checkpoints"
    assert sorted(d.parent.name for d in ckpts.glob("*/manifest.json")) == ["step-000004", "step-000005"]


def test_a_full_disk_delays_the_checkpoint_until_space_returns(
        tmp_path: Path, run: tuple[RunConfig, RunSetup, LocalStore, list[dict]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The background write hits ENOSPC twice: a disk_full event names it, the write is
    retried, and the checkpoint becomes durable once it succeeds."""
    cfg, setup, store, rows = run
    svc = TrainerService(tmp_path / "node")
    folder = Path(svc.ensure_version(setup, 0).model_path)
    checksum = _train(svc, setup, cfg, store, rows, 1, folder)
    assert svc.ckpts is not None
    svc.ckpts.retry = type(svc.ckpts.retry)(base_s=0.05, max_s=0.1, deadline_s=60)
    from gpu_runtime.trainer.common import snapshot
    real, failures = snapshot.save_file, [2]

    def full_disk(tensors: dict, path: str, *a: object, **kw: object) -> None:
        if failures[0] > 0:
            failures[0] -= 1
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real(tensors, path, *a, **kw)

    monkeypatch.setattr(snapshot, "save_file", full_disk)
    svc.save_checkpoint(1, data_cursor=cfg.rollout.prompts_per_step)
    assert svc.wait_for_uploads(60)
    events = [e for e in svc.new_events() if isinstance(e, DiskFull)]
    assert len(events) == 1 and "No space left on device" in events[0].error
    assert events[0].step == 1 and events[0].free_bytes is not None
    fresh = TrainerService(tmp_path / "fresh")
    assert fresh.ensure_version(setup, 1).checksum == checksum
