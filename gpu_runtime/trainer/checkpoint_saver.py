"""A run's checkpoints as the trainer saves them: the state copied out of the trainer now,
written, hashed and uploaded with the version's model folder on the upload thread.

The step that asks for a checkpoint waits only for the copy (``StateSnapshot`` into reused
``SnapshotBuffers``; a fsdp2 cell, DP cells and the megatron trainer write their state into a
local folder instead, their ranks holding the shards). The next checkpoint waits for the
previous one to be durable (or given up): its buffers are reused, and the store commits one
checkpoint at a time. A crash before a manifest is written leaves the previous durable
checkpoint, which restore + replay start from (DESIGN §6).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from gpu_runtime.models.model_folder import link_folder
from gpu_runtime.proc import faults
from gpu_runtime.proc.disk import is_no_space
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.checkpoint_handle import CheckpointHandle
from gpu_runtime.store.checkpoint_manifest import CheckpointInfo
from gpu_runtime.store.checkpoint_store import CheckpointStore
from gpu_runtime.store.object_store import ObjectStore
from gpu_runtime.trainer.common.snapshot import SnapshotBuffers
from gpu_runtime.trainer.protocol import Trainer
from gpu_runtime.trainer.work_dir import upload_weights_folder, weights_folder
from spec.trainer_rpc import CheckpointSaved, RunSetup

log = logging.getLogger(__name__)


class CheckpointSaver:
    def __init__(self, store: ObjectStore, setup: RunSetup, work_dir: Path,
                 accept: Callable[[CheckpointInfo], bool]) -> None:
        self.store = store
        self.run_id = setup.run_id
        self.setup = setup
        self.work_dir = work_dir
        self.ckpts = CheckpointStore(
            store, art.checkpoints_prefix(setup.run_id), local_dir=work_dir / setup.run_id / "checkpoints",
            keep_last=setup.keep_last, accept=accept,
            keep_local=False,  # a restore reads the store: a node keeps a checkpoint only until it is durable
            on_durable=self._prune_stored_weights,
        )
        self.buffers = SnapshotBuffers()  # host copies of the trainer's state, reused by every checkpoint
        self._warming: threading.Thread | None = None  # their allocation after the first train step

    def save(self, trainer: Trainer, step: int, *, data_cursor: int, sync: bool = False,
             checksum: str | None = None) -> CheckpointSaved:
        """Checkpoint ``trainer`` (at version ``step``); ``sync``: durable before this returns.
        ``checksum``: the version's published checksum, when the caller holds it."""
        if trainer.policy_version != step:
            raise RuntimeError(f"checkpoint step {step} but trainer holds v{trainer.policy_version}")
        t0 = time.perf_counter()
        self.ckpts.wait_for_uploads()
        waited = time.perf_counter() - t0
        meta = {
            "step": step,
            "policy_version": trainer.policy_version,
            "data_cursor": data_cursor,
            "config_hash": self.setup.config_hash,
            "epoch": self.setup.epoch,  # the placement that wrote it (fencing: Fence.accepts)
        }
        write = self._state_writer(trainer, checksum, step)
        folder = self._version_folder_copy(step)
        handle = self.ckpts.save_written(step, write, meta, sync=sync, extra=folder)
        if sync and not handle.durable:  # asked durable: the call fails (a full disk: the run waits and asks again)
            last = handle.last_error
            raise last if last is not None and is_no_space(last) else (handle.error or RuntimeError(
                f"checkpoint step {step} is not durable"))
        log.info("checkpoint step %d: %.2fs waiting for the previous one, %.2fs to snapshot%s", step, waited,
                 time.perf_counter() - t0 - waited, "" if sync else "; uploading")
        return CheckpointSaved(step=step, durable=bool(handle.durable),
                               key=f"{art.checkpoints_prefix(self.run_id)}/step-{step:06d}",
                               weights_key=folder[0] if folder is not None else "")

    def prepare(self, trainer: Trainer) -> None:
        """After a train step, while the trainer waits for the engines: the snapshot's buffers
        allocated in the background (once: the shapes stay), off the next checkpoint's stall."""
        if self._warming is None or not self._warming.is_alive():
            self._warming = trainer.warm_snapshot(self.buffers)

    def _state_writer(self, trainer: Trainer, checksum: str | None, step: int) -> Callable[[Path], None]:
        """The trainer's state, taken now, as a writer for the upload thread."""
        write = trainer.state_writer(self.buffers, checksum, self.work_dir)

        def write_state(folder: Path) -> None:
            faults.delay("upload", step)
            write(folder)
        return write_state

    def _version_folder_copy(self, step: int) -> tuple[str, Path] | None:
        """Hard links to version ``step``'s exported model folder (pruning the version folders
        cannot take it from the upload), uploaded beside its checkpoint."""
        src = weights_folder(self.work_dir, self.run_id, step)
        if not src.is_dir():
            return None
        dst = upload_weights_folder(self.work_dir, self.run_id, step)
        shutil.rmtree(dst, ignore_errors=True)
        link_folder(src, dst)
        return art.weights_prefix(self.run_id, step), dst

    def _prune_stored_weights(self, _handle: CheckpointHandle) -> None:
        """After a checkpoint is durable: the store keeps the model folders of v0 (the
        post-SFT policy), of the run's durable checkpoints (``checkpoint.keep_last``) and of the
        versions the config keeps (``checkpoint.keep_versions``)."""
        kept = {0} | {c.step for c in self.ckpts.list_durable()} | set(self.setup.keep_versions)
        prefix = f"{art.run_prefix(self.run_id)}/weights/"
        versions = {key[len(prefix):].partition("/")[0] for key in self.store.list(prefix)}
        for name in sorted(versions):
            if name.startswith("v") and name[1:].isdigit() and int(name[1:]) not in kept:
                self.store.delete_prefix(f"{prefix}{name}/")

    def wait(self, timeout_s: float | None = None) -> bool:
        return self.ckpts.wait_for_uploads(timeout_s)
