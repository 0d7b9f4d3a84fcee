"""``resume_state`` on a real local store: a broken run is a ResumeError (one CLI line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_runtime.store import artifacts as art
from gpu_runtime.store.checkpoint_store import CheckpointStore
from gpu_runtime.store.object_store import LocalStore
from milestone_cli.resume import ResumeError, resume_state
from spec.run import RunConfig


def test_missing_dataset_is_a_resume_error(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    weights = tmp_path / "ckpt"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"x")
    ckpts = CheckpointStore(store, art.checkpoints_prefix("r"), local_dir=tmp_path / "local")
    ckpts.save(1, weights, {"policy_version": 1, "data_cursor": 4}, sync=True)
    ckpts.close()
    cfg = RunConfig(steps=3, store=f"file://{tmp_path / 'store'}")
    with pytest.raises(ResumeError, match="run r: its dataset runs/r/data/train.jsonl is missing"):
        resume_state(cfg, "r")
    store.put_bytes(art.dataset_key("r", "train"), b'{"id": "0"}\n')
    run_id, _, state = resume_state(cfg, "r")
    assert run_id == "r" and state.next_step == 2 and state.data_cursor == 4 and state.dataset.n_rows == 1
    assert state.dataset.eval_key is None  # a run without a held-out split is not evaluated
    store.put_bytes(art.dataset_key("r", "eval"), b'{"id": "e0"}\n{"id": "e1"}\n')
    _, _, state = resume_state(cfg, "r")
    assert (state.dataset.eval_key, state.dataset.n_eval) == (art.dataset_key("r", "eval"), 2)
    off = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"enabled": False})})
    assert resume_state(off, "r")[2].dataset.eval_key is None
