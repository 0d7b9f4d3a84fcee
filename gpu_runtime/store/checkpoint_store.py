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
from typing import Any, TypeVar

from gpu_runtime.store.checkpoint_manifest import (  # noqa: F401  (re-exported)
    _STEP_DIR,
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
from gpu_runtime.store.checkpoint_handle import (
    CheckpointHandle, Writer, copy_and_hash, file_hash, hash_files,
)
from gpu_runtime.proc.disk import free_bytes, is_no_space
from gpu_runtime.store.object_store import ObjectStore, StoreError, file_sha256

log = logging.getLogger(__name__)
T = TypeVar("T")


class CheckpointStore:
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
        self.local_dir = Path(local_dir)
        self.keep_last = keep_last
        self.retry = retry or RetryPolicy()
        # a manifest it refuses is not durable state (fencing: written by a placement left behind)
        self.accept = accept
        self.keep_local = keep_local
        self.on_durable = on_durable  # called on the upload thread after a commit and its retention
        self.events: list[dict[str, Any]] = []
        self._queue: queue.Queue[CheckpointHandle | None] = queue.Queue()
        self._pending: list[CheckpointHandle] = []
        self._lock = threading.Lock()  # serializes uploads and retention
        self._pending_lock = threading.Lock()
        self._closing = threading.Event()
        self._worker: threading.Thread | None = None
        self._disk_full_reported: set[tuple[int, str]] = set()  # (step, what): one disk_full event each

    # -- keys ---------------------------------------------------------------------

    def _key(self, name: str, rel: str) -> str:
        return f"{self.prefix}/{name}/{rel}" if self.prefix else f"{name}/{rel}"

    def _split(self, key: str) -> tuple[str, str] | None:
        rest = key[len(self.prefix) + 1 :] if self.prefix else key
        name, _, rel = rest.partition("/")
        return (name, rel) if _STEP_DIR.match(name) and rel else None

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
            self._upload(handle)
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
            self._upload(handle)

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

    def _with_retry(self, handle: CheckpointHandle, deadline: float, what: str, fn: Callable[[], T]) -> T:
        delay = self.retry.base_s
        while True:
            try:
                return fn()
            except Exception as e:  # noqa: BLE001  (store, disk and missing-key errors retry; the rest do not)
                full = is_no_space(e, [self.local_dir])  # safetensors' SafetensorError too
                if not (full or isinstance(e, (StoreError, OSError, KeyError))):
                    raise
                handle.failures += 1
                handle.last_error = e
                if full and (handle.step, what) not in self._disk_full_reported:
                    self._disk_full(handle, what, e)
                left = deadline - time.monotonic()
                if left <= 0 or self._closing.is_set():
                    raise CheckpointUploadError(
                        f"checkpoint {step_name(handle.step)}: {what} failed {handle.failures} time(s), "
                        f"giving up after {self.retry.deadline_s:.0f}s deadline; last error: {e}"
                    ) from e
                log.warning("checkpoint %s: %s failed (%s); retry in %.1fs",
                            step_name(handle.step), what, e, min(delay, left))
                self._closing.wait(min(delay, left))
                delay = min(delay * 2, self.retry.max_s)

    def _upload(self, h: CheckpointHandle) -> None:
        with self._lock:
            t0 = time.monotonic()
            deadline = t0 + self.retry.deadline_s
            name = step_name(h.step)
            manifest_key = self._key(name, MANIFEST)
            try:
                if h.write is not None:  # a snapshot: its files are written here, off the caller's path
                    self._with_retry(h, deadline, f"write {h.local_path}", lambda: self._write(h))
                # an older manifest of this step must never describe the new files
                self._with_retry(h, deadline, "remove stale manifest", lambda: self.store.delete(manifest_key))
                base = self._with_retry(h, deadline, "read previous manifest", lambda: self._newest_before(h.step))
                entries: dict[str, dict[str, Any]] = {}
                for rel, (sha, size) in h.files.items():
                    prev = base.files.get(rel) if base else None
                    if prev and prev.sha256 == sha and prev.size == size and prev.stored_in != name:
                        prev_key = self._key(prev.stored_in, rel)
                        if self._with_retry(h, deadline, f"check {prev_key}", lambda k=prev_key: self.store.exists(k)):
                            entries[rel] = {"sha256": sha, "size": size, "stored_in": prev.stored_in}
                            h.skipped.append(rel)
                            continue
                    self._with_retry(h, deadline, f"upload {rel}", lambda r=rel, s=sha, n=size: self._put_verified(name, h, r, s, n))
                    entries[rel] = {"sha256": sha, "size": size, "stored_in": name}
                    h.uploaded.append(rel)
                if h.extra is not None:
                    self._upload_extra(h, deadline)
                doc = {"format": FORMAT, "step": h.step, "created_at": time.time(), "meta": h.meta, "files": entries}
                data = json.dumps(doc, indent=1, sort_keys=True).encode()
                self._with_retry(h, deadline, "commit manifest", lambda: self._put_manifest(manifest_key, data))
            except Exception as e:  # CheckpointUploadError after the deadline, or not retryable
                log.log(logging.ERROR, "checkpoint %s not durable (the previous durable one stays): %s", name, e,
                        exc_info=not isinstance(e, CheckpointUploadError))
                self.events.append({"kind": "checkpoint_upload_failed", "step": h.step, "error": str(e)})
                self._drop_local(h)
                h._finish(e)
                return
            h.upload_seconds = time.monotonic() - t0
            log.info("checkpoint %s durable in %.2fs (%s%d uploaded, %d unchanged, %d failed attempts)",
                     name, h.upload_seconds, "" if h.write_seconds is None else f"written in {h.write_seconds:.2f}s, ",
                     len(h.uploaded), len(h.skipped), h.failures)
            try:  # before _finish, so a waiter sees the store already pruned
                self._apply_retention()
            except (StoreError, OSError) as e:
                log.warning("checkpoint retention after %s failed (will retry next time): %s", name, e)
            self._drop_local(h)
            if self.on_durable is not None:
                try:
                    self.on_durable(h)
                except (StoreError, OSError) as e:
                    log.warning("after checkpoint %s: %s", name, e)
            h._finish(None)

    def _write(self, h: CheckpointHandle) -> None:
        """Run the handle's writer into a fresh folder, then hash what it wrote."""
        assert h.write is not None
        t0 = time.monotonic()
        tmp = self.local_dir / f".{step_name(h.step)}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        h.write(tmp)
        files = hash_files(tmp)
        if not files:
            raise ValueError(f"checkpoint {step_name(h.step)}: the writer wrote no files")
        shutil.rmtree(h.local_path, ignore_errors=True)
        tmp.rename(h.local_path)
        h.files, h.write = files, None  # written: a retry of a later part does not write again
        h.write_seconds = time.monotonic() - t0

    def _upload_extra(self, h: CheckpointHandle, deadline: float) -> None:
        assert h.extra is not None
        prefix, folder = h.extra
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            key = f"{prefix}/{path.relative_to(folder).as_posix()}"
            sha, size = self._with_retry(h, deadline, f"hash {path}", lambda p=path: file_hash(p))
            self._with_retry(h, deadline, f"upload {key}",
                             lambda k=key, p=path, s=sha, n=size: self._put_checked(k, p, s, n))

    def _drop_local(self, h: CheckpointHandle) -> None:
        """With ``keep_local=False``: the local copy goes once the checkpoint ended (durable or
        given up); the extra folder always goes (the caller made it for this upload)."""
        if not self.keep_local:
            shutil.rmtree(h.local_path, ignore_errors=True)
        if h.extra is not None:
            shutil.rmtree(h.extra[1], ignore_errors=True)

    def _disk_full(self, h: CheckpointHandle, what: str, err: BaseException) -> None:
        """One ``disk_full`` event per failing write (it is retried with the rest)."""
        self._disk_full_reported.add((h.step, what))
        free = free_bytes(self.local_dir)
        self.events.append({"kind": "disk_full", "step": h.step, "what": what, "free_bytes": free,
                            "error": str(err)})
        log.warning("checkpoint %s: %s: disk full (%d bytes free): retrying until space returns",
                    step_name(h.step), what, free)

    def _put_verified(self, name: str, h: CheckpointHandle, rel: str, sha: str, size: int) -> None:
        self._put_checked(self._key(name, rel), h.local_path / rel, sha, size)

    def _put_checked(self, key: str, path: Path, sha: str, size: int) -> None:
        """Upload ``path`` to ``key`` and verify the stored object (size + sha256)."""
        self.store.put_file(key, path)
        if not self.store.verify_file(key, path, sha, size):
            raise StoreError(f"{self.store.uri(key)}: stored object does not match sha256 {sha[:12]}.. / size {size}")

    def _put_manifest(self, key: str, data: bytes) -> None:
        self.store.put_bytes(key, data)
        if self.store.get_bytes(key) != data:
            raise StoreError(f"{self.store.uri(key)}: manifest read back differs from what was written")

    # -- read -----------------------------------------------------------------------

    def _manifest_names(self) -> list[str]:
        """Step folders with a manifest, oldest first."""
        names = []
        for key in self.store.list(self.prefix + "/" if self.prefix else ""):
            parts = self._split(key)
            if parts and parts[1] == MANIFEST:
                names.append(parts[0])
        return sorted(names, key=lambda n: int(n[5:]))

    def _load(self, name: str) -> CheckpointInfo | None:
        try:
            info = parse_manifest(name, self.store.get_bytes(self._key(name, MANIFEST)))
        except KeyError:
            return None
        except ValueError as e:
            log.warning("ignoring unparsable manifest: %s", e)
            return None
        if self.accept is not None and not self.accept(info):
            log.warning("ignoring checkpoint %s: its writer was left behind by a newer placement (meta %s)",
                        name, info.meta)
            return None
        return info

    def list_durable(self) -> list[CheckpointInfo]:
        """Every checkpoint whose manifest exists and parses, oldest first."""
        return [i for n in self._manifest_names() if (i := self._load(n)) is not None]

    def latest_durable(self) -> CheckpointInfo | None:
        for name in reversed(self._manifest_names()):
            if (info := self._load(name)) is not None:
                return info
        return None

    def _newest_before(self, step: int) -> CheckpointInfo | None:
        for name in reversed(self._manifest_names()):
            if int(name[5:]) < step and (info := self._load(name)) is not None:
                return info
        return None

    def restore(self, into: str | Path, step: int | None = None) -> CheckpointInfo:
        """Download the newest (or the given) durable checkpoint into ``into`` (replaced),
        verifying every file; a corrupt or incomplete one is reported in ``events`` and the
        previous durable one is tried. Raises NoUsableCheckpointError if none verifies."""
        into = Path(into)
        durable = self.list_durable()
        candidates = [i for i in reversed(durable) if step is None or i.step <= step]
        if step is not None and (not candidates or candidates[0].step != step):
            raise NoUsableCheckpointError(f"{self.store.uri(self.prefix or '.')}: no durable checkpoint {step_name(step)}")
        if not candidates:
            raise NoUsableCheckpointError(f"{self.store.uri(self.prefix or '.')}: no durable checkpoint")
        tmp = into.parent / f".{into.name}.restoring"
        for info in candidates:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            if self._download_verified(info, tmp):
                shutil.rmtree(into, ignore_errors=True)
                tmp.rename(into)
                log.info("restored checkpoint %s into %s", info.name, into)
                return info
        shutil.rmtree(tmp, ignore_errors=True)
        tried = ", ".join(i.name for i in candidates)
        raise NoUsableCheckpointError(f"{self.store.uri(self.prefix or '.')}: no checkpoint verifies (tried {tried}); see events")

    def _download_verified(self, info: CheckpointInfo, dest: Path) -> bool:
        for rel, e in info.files.items():
            path = dest / rel
            try:
                self.store.get_file(self._key(e.stored_in, rel), path)
                actual = file_sha256(path)
            except KeyError:
                actual = "missing"
            if actual != e.sha256:
                event = {"kind": "checkpoint_corrupt", "step": info.step, "file": rel, "stored_in": e.stored_in,
                         "expected": e.sha256, "actual": actual}
                self.events.append(event)
                log.error("checkpoint %s corrupt: %s (in %s) sha256 expected %s, got %s; trying the previous one",
                          info.name, rel, e.stored_in, e.sha256, actual)
                return False
        return True

    # -- retention ------------------------------------------------------------------

    def _apply_retention(self) -> None:
        """Keep the newest ``keep_last`` durable checkpoints and every file they reference;
        delete older checkpoints (manifest first) and leftovers of failed uploads."""
        durable = self.list_durable()
        if not durable:
            return
        kept = durable[-self.keep_last :]
        kept_names = {i.name for i in kept}
        newest = durable[-1].step
        referenced = {(e.stored_in, rel) for i in kept for rel, e in i.files.items()}
        doomed: list[tuple[str, str]] = []
        for key in self.store.list(self.prefix + "/" if self.prefix else ""):
            parts = self._split(key)
            if parts is None or parts[0] in kept_names or int(parts[0][5:]) >= newest:
                continue
            if parts not in referenced:
                doomed.append(parts)
        # manifests first: a checkpoint disappears before any of its files do
        for name, rel in sorted(doomed, key=lambda x: x[1] != MANIFEST):
            self.store.delete(self._key(name, rel))
        if doomed:
            log.info("retention: deleted %d objects; kept %s", len(doomed), sorted(kept_names))
        oldest_kept = kept[0].step
        with self._pending_lock:
            busy = {h.step for h in self._pending if not h.done}
        for d in self.local_dir.glob("step-*"):
            m = _STEP_DIR.match(d.name)
            if m and int(m.group(1)) < oldest_kept and int(m.group(1)) not in busy and d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
