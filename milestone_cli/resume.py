"""``milestone start CONFIG --resume-from RUN_OR_CHECKPOINT_URI``.

A resume continues the same run id (its artifacts and checkpoints live under it)
from the step after a durable checkpoint — never from step 0. A resumed fork keeps
its lineage (read from its previous execution's input in Temporal), so its steps up to
the fork point are still read from its ancestors.
"""

from __future__ import annotations

import hashlib
import re
import tempfile

from gpu_runtime.store import artifacts as art
from gpu_runtime.store.checkpoint_store import CheckpointStore
from gpu_runtime.store.lineage import Lineage
from gpu_runtime.store.object_store import ObjectStore
from gpu_runtime.store.uri import open_store
from spec.run import RunConfig
from workflows.contracts.placement import DatasetInfo
from workflows.run_state import RunState

CHECKPOINT_URI = re.compile(r"^(?P<root>.+)/runs/(?P<run>[^/]+)/checkpoints/step-(?P<step>\d+)/?$")


class ResumeError(ValueError):
    """The resume cannot start; the message says why."""


class NothingToResume(ResumeError):
    """The checkpoint already covers every step the config asks for."""


def parse_target(target: str, cfg: RunConfig) -> tuple[str, str, int | None]:
    """-> (store root URI, run id, checkpoint step or None for the newest)."""
    m = CHECKPOINT_URI.match(target)
    if m:
        return m.group("root"), m.group("run"), int(m.group("step"))
    if "://" in target or "/" in target:
        raise ResumeError(f"--resume-from {target!r}: expected a run id or <store>/runs/<run>/checkpoints/step-N")
    return cfg.store, target, None


def resume_state(cfg: RunConfig, target: str, lineage: Lineage = ()) -> tuple[str, RunConfig, RunState]:
    """Find the durable checkpoint and build the run's state after it. ``lineage``: the
    run's ancestors when it is a fork (its previous execution's input says), whose first
    run holds the dataset."""
    root, run_id, step = parse_target(target, cfg)
    if root.rstrip("/") != cfg.store.rstrip("/"):
        cfg = cfg.model_copy(update={"store": root})
    store = open_store(root)
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = CheckpointStore(store, art.checkpoints_prefix(run_id), local_dir=tmp)
        durable = ckpts.list_durable()
        chosen = [c for c in durable if step is None or c.step == step]
        if not chosen:
            what = f"step {step}" if step is not None else "any step"
            raise ResumeError(f"run {run_id}: no durable checkpoint for {what} in {root}")
        info = chosen[-1]
    meta = info.meta
    if cfg.steps <= info.step:
        raise NothingToResume(
            f"nothing to resume: run {run_id} is checkpointed at step {info.step} and the config asks for "
            f"steps: {cfg.steps}; raise `steps` to train further"
        )
    try:
        dataset = stored_dataset(store, lineage[0][0] if lineage else run_id, cfg)
    except ResumeError as err:
        if lineage:
            raise
        raise ResumeError(f"{err} (a fork reads its first ancestor's dataset: is {run_id} a fork that "
                          "Temporal no longer knows? Fork its parent again instead)") from None
    state = RunState(
        next_step=info.step + 1,
        policy_version=int(meta.get("policy_version", info.step)),
        data_cursor=int(meta.get("data_cursor", 0)),
        initialized=True,
        dataset=dataset,
        train=cfg.train,
    )
    return run_id, cfg, state


def stored_dataset(store: ObjectStore, run_id: str, cfg: RunConfig) -> DatasetInfo:
    """The dataset (and held-out split) ``prepare_data`` wrote when ``run_id`` began."""
    data_key = art.dataset_key(run_id, "train")
    try:
        data = store.get_bytes(data_key)
    except KeyError:
        raise ResumeError(f"run {run_id}: its dataset {data_key} is missing from {cfg.store}") from None
    dataset = DatasetInfo(key=data_key, n_rows=data.count(b"\n"), sha256=hashlib.sha256(data).hexdigest())
    eval_key = art.dataset_key(run_id, "eval")
    if cfg.eval.enabled and store.exists(eval_key):  # the held-out split written when the run began
        dataset = dataset.model_copy(update={"eval_key": eval_key, "n_eval": store.get_bytes(eval_key).count(b"\n")})
    return dataset
