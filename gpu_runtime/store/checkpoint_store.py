"""Checkpoints: save locally, upload in the background, commit with a manifest written last.

Store layout (``prefix/step-000012/...``)::

    step-000012/<relpath>        files uploaded by this checkpoint
    step-000012/manifest.json    commit marker, written last after every object is verified:
        {"format": 1, "step": 12, "created_at": ..., "meta": {...},
         "files": {"<relpath>": {"sha256": ..., "size": ..., "stored_in": "step-000010"}}}

A file whose sha256 equals the previous durable checkpoint's same-named file is not
uploaded again; its entry points (``stored_in``) at the folder that holds the bytes.
A checkpoint is durable when its manifest exists and parses. Uploads run one at a time
(a single worker thread, or the caller's thread with ``sync=True``), so retention, which
runs after each commit, never races an upload of this store.

``save`` copies a written folder; ``save_written`` takes a writer instead (a trainer's
in-memory state snapshot): the upload thread writes the files, hashes and uploads them, so the
caller waits for neither the disk nor the store. A write or upload that fails for lack of
space (ENOSPC) is retried like any other (``RetryPolicy``) and reported once as a
``disk_full`` event. With ``keep_local=False`` the local copy is removed once the checkpoint
is durable (a restore reads the store).
"""

from __future__ import annotations

import json
import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_runtime.store.checkpoint_manifest import (  # noqa: F401  (re-exported)
    FORMAT,
    MANIFEST,
    CheckpointInfo,
    CheckpointUploadError,
    FileEntry,
    NoUsableCheckpointError,
    RetryPolicy,
    parse_manifest,
    step_name,
)
from gpu_runtime.store.checkpoint_handle import CheckpointHandle, Writer, copy_and_hash, file_hash
from gpu_runtime.store.checkpoint_restore import CheckpointKeys, CheckpointReader
from gpu_runtime.store.checkpoint_retention import apply_retention
from gpu_runtime.store.checkpoint_upload import CheckpointUploader
from gpu_runtime.store.object_store import ObjectStore
from spec.events import RunEvent

log = logging.getLogger(__name__)


class CheckpointStore:
    """A prefix's checkpoints: ``save`` / ``save_written`` queue one, ``CheckpointUploader``
    uploads and commits it, ``apply_retention`` prunes after each commit, ``CheckpointReader``
    lists and restores. ``events``: what went wrong, for the run's report (shared by the parts)."""

    def __init__(
        self,
        store: ObjectStore,
        prefix: str,
        local_dir: str | Path,
        keep_last: int = 3,
        *,
        retry: RetryPolicy | None = None,
        accept: Callable[[CheckpointInfo], bool] | None = None,
        keep_local: bool = True,
        on_durable: Callable[[CheckpointHandle], None] | None = None,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.store = store
        self.prefix = prefix.strip("/")
        self.keys = CheckpointKeys(self.prefix)
        self.local_dir = Path(local_dir)
        self.keep_last = keep_last
        self.events: list[RunEvent] = []
        self.reader = CheckpointReader(store, self.keys, self.events, accept)
        self._closing = threading.Event()
        self.uploader = CheckpointUploader(
            store, self.reader, self.local_dir, retry or RetryPolicy(), self.events, self._closing,
            keep_local=keep_local, after_commit=self._apply_retention,
            on_durable=on_durable,  # called on the upload thread after a commit and its retention
        )
        self._queue: queue.Queue[CheckpointHandle | None] = queue.Queue()
        self._pending: list[CheckpointHandle] = []
        self._pending_lock = threading.Lock()
        self._worker: threading.Thread | None = None

    @property
    def retry(self) -> RetryPolicy:
        """How an upload retries (tests shorten it on a live store)."""
        return self.uploader.retry

    @retry.setter
    def retry(self, policy: RetryPolicy) -> None:
        self.uploader.retry = policy

    # -- save ---------------------------------------------------------------------

    def save(self, step: int, folder: str | Path, meta: dict[str, Any], *, sync: bool = False) -> CheckpointHandle:
        """Copy ``folder`` to ``local_dir/step-XXXXXX`` (hashing on the way), then upload it
        (background thread, or here with ``sync=True``). The caller may reuse ``folder``."""
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
        if (folder / MANIFEST).exists():
            raise ValueError(f"{folder / MANIFEST}: name is reserved for the checkpoint manifest")
        self._check_saving(step, meta)
        dest = self.local_dir / step_name(step)
        files: dict[str, tuple[str, int]] = {}
        sources = sorted(p for p in folder.rglob("*") if p.is_file())
        if not sources:
            raise ValueError(f"checkpoint folder {folder} has no files")
        if dest.resolve() == folder.resolve():
            for p in sources:
                files[p.relative_to(folder).as_posix()] = file_hash(p)
        else:
            tmp = self.local_dir / f".{step_name(step)}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            for p in sources:
                rel = p.relative_to(folder).as_posix()
                files[rel] = copy_and_hash(p, tmp / rel)
            shutil.rmtree(dest, ignore_errors=True)
            tmp.rename(dest)
        return self._enqueue(CheckpointHandle(step, dest, files, dict(meta)), sync)

    def save_written(
        self, step: int, write: Writer, meta: dict[str, Any], *, sync: bool = False,
        extra: tuple[str, Path] | None = None,
    ) -> CheckpointHandle:
        """Queue a checkpoint whose files ``write`` puts into an empty folder (on the upload
        thread, or here with ``sync=True``); ``extra``: a folder uploaded under a store prefix
        before the manifest (the version's model folder)."""
        self._check_saving(step, meta)
        handle = CheckpointHandle(step, self.local_dir / step_name(step), {}, dict(meta), write=write, extra=extra)
        return self._enqueue(handle, sync)

    def _check_saving(self, step: int, meta: dict[str, Any]) -> None:
        """What ``save`` and ``save_written`` refuse before anything is written."""
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        try:
            json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"checkpoint meta for step {step} is not JSON-serializable: {e}") from None
        if self._closing.is_set():
            raise RuntimeError("CheckpointStore is closed")

    def _enqueue(self, handle: CheckpointHandle, sync: bool) -> CheckpointHandle:
        if sync:
            self.wait_for_uploads()
            self.uploader.upload(handle)
            return handle
        with self._pending_lock:
            self._pending = [h for h in self._pending if not h.done] + [handle]
        self._ensure_worker()
        self._queue.put(handle)
        return handle

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._run, name="checkpoint-upload", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while (handle := self._queue.get()) is not None:
            self.uploader.upload(handle)

    def wait_for_uploads(self, timeout: float | None = None) -> bool:
        """Wait for queued uploads; True when all finished and are durable."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._pending_lock:
            pending = list(self._pending)
        for h in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h.wait(left):
                return False
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Wait for uploads (up to ``timeout``), then stop the worker (an upload still
        running gives up at its next retry). True when everything queued became durable."""
        ok = self.wait_for_uploads(timeout)
        self._closing.set()
        self._queue.put(None)
        return ok

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- read ---------------------------------------------------------------------

    def list_durable(self) -> list[CheckpointInfo]:
        """Every checkpoint whose manifest exists and parses, oldest first."""
        return self.reader.list_durable()

    def latest_durable(self) -> CheckpointInfo | None:
        return self.reader.latest_durable()

    def restore(self, into: str | Path, step: int | None = None) -> CheckpointInfo:
        """Download the newest (or the given) durable checkpoint into ``into`` (replaced),
        verifying every file; a corrupt or incomplete one is reported in ``events`` and the
        previous durable one is tried. Raises NoUsableCheckpointError if none verifies."""
        return self.reader.restore(into, self.list_durable(), step)

    # -- retention ------------------------------------------------------------------

    def _apply_retention(self) -> None:
        """Keep the newest ``keep_last`` durable checkpoints and every file they reference;
        delete older checkpoints (manifest first) and leftovers of failed uploads."""
        apply_retention(self.store, self.keys, self.local_dir, self.keep_last, self.list_durable(), self._busy_steps)

    def _busy_steps(self) -> set[int]:
        """The steps still uploading (their local folders stay)."""
        with self._pending_lock:
            return {h.step for h in self._pending if not h.done}
