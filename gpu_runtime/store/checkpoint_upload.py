"""One checkpoint's upload: its files written (a writer's) and hashed, uploaded unless the
previous durable checkpoint holds the same bytes, each stored object verified, the extra
folder uploaded, and the manifest committed last; then retention and ``on_durable``.

A failure of the store, the disk or a missing key is retried (``RetryPolicy``: exponential
backoff until its deadline); a write that fails for lack of space is reported once as a
``disk_full`` event. A checkpoint that is given up is reported as
``checkpoint_upload_failed`` and the previous durable one stays. Uploads run one at a time
(``CheckpointStore``'s worker thread, or the caller's with ``sync=True``).
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from gpu_runtime.proc.disk import free_bytes, is_no_space
from gpu_runtime.store.checkpoint_handle import CheckpointHandle, file_hash, hash_files
from gpu_runtime.store.checkpoint_manifest import FORMAT, MANIFEST, CheckpointUploadError, RetryPolicy, step_name
from gpu_runtime.store.checkpoint_restore import CheckpointKeys, CheckpointReader
from gpu_runtime.store.object_store import ObjectStore, StoreError
from spec.events import CheckpointUploadFailed, DiskFull, RunEvent, utc_now

log = logging.getLogger(__name__)
T = TypeVar("T")


class CheckpointUploader:
    def __init__(
        self,
        store: ObjectStore,
        reader: CheckpointReader,
        local_dir: Path,
        retry: RetryPolicy,
        events: list[RunEvent],
        closing: threading.Event,
        *,
        keep_local: bool,
        after_commit: Callable[[], None],
        on_durable: Callable[[CheckpointHandle], None] | None,
    ) -> None:
        self.store = store
        self.reader = reader  # the previous durable checkpoint (unchanged files are not uploaded again)
        self.keys: CheckpointKeys = reader.keys
        self.local_dir = local_dir
        self.retry = retry
        self.events = events  # the CheckpointStore's
        self.closing = closing  # set: a retry gives up at once (the store is closing)
        self.keep_local = keep_local
        self.after_commit = after_commit  # retention, before ``on_durable`` and before a waiter wakes
        self.on_durable = on_durable
        self.lock = threading.Lock()  # serializes uploads and retention
        self._disk_full_reported: set[tuple[int, str]] = set()  # (step, what): one disk_full event each

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
                if left <= 0 or self.closing.is_set():
                    raise CheckpointUploadError(
                        f"checkpoint {step_name(handle.step)}: {what} failed {handle.failures} time(s), "
                        f"giving up after {self.retry.deadline_s:.0f}s deadline; last error: {e}"
                    ) from e
                log.warning("checkpoint %s: %s failed (%s); retry in %.1fs",
                            step_name(handle.step), what, e, min(delay, left))
                self.closing.wait(min(delay, left))
                delay = min(delay * 2, self.retry.max_s)

    def upload(self, h: CheckpointHandle) -> None:
        with self.lock:
            t0 = time.monotonic()
            deadline = t0 + self.retry.deadline_s
            name = step_name(h.step)
            manifest_key = self.keys.key(name, MANIFEST)
            try:
                if h.write is not None:  # a snapshot: its files are written here, off the caller's path
                    self._with_retry(h, deadline, f"write {h.local_path}", lambda: self._write(h))
                # an older manifest of this step must never describe the new files
                self._with_retry(h, deadline, "remove stale manifest", lambda: self.store.delete(manifest_key))
                base = self._with_retry(h, deadline, "read previous manifest", lambda: self.reader.newest_before(h.step))
                entries: dict[str, dict[str, Any]] = {}
                for rel, (sha, size) in h.files.items():
                    prev = base.files.get(rel) if base else None
                    if prev and prev.sha256 == sha and prev.size == size and prev.stored_in != name:
                        prev_key = self.keys.key(prev.stored_in, rel)
                        if self._with_retry(h, deadline, f"check {prev_key}", partial(self.store.exists, prev_key)):
                            entries[rel] = {"sha256": sha, "size": size, "stored_in": prev.stored_in}
                            h.skipped.append(rel)
                            continue
                    self._with_retry(h, deadline, f"upload {rel}", partial(self._put_verified, name, h, rel, sha, size))
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
                self.events.append(CheckpointUploadFailed(at=utc_now(), step=h.step, error=str(e)))
                self._drop_local(h)
                h._finish(e)
                return
            h.upload_seconds = time.monotonic() - t0
            log.info("checkpoint %s durable in %.2fs (%s%d uploaded, %d unchanged, %d failed attempts)",
                     name, h.upload_seconds, "" if h.write_seconds is None else f"written in {h.write_seconds:.2f}s, ",
                     len(h.uploaded), len(h.skipped), h.failures)
            try:  # before _finish, so a waiter sees the store already pruned
                self.after_commit()
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
            sha, size = self._with_retry(h, deadline, f"hash {path}", partial(file_hash, path))
            self._with_retry(h, deadline, f"upload {key}", partial(self._put_checked, key, path, sha, size))

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
        self.events.append(DiskFull(at=utc_now(), step=h.step, what=what, free_bytes=free, error=str(err)))
        log.warning("checkpoint %s: %s: disk full (%d bytes free): retrying until space returns",
                    step_name(h.step), what, free)

    def _put_verified(self, name: str, h: CheckpointHandle, rel: str, sha: str, size: int) -> None:
        self._put_checked(self.keys.key(name, rel), h.local_path / rel, sha, size)

    def _put_checked(self, key: str, path: Path, sha: str, size: int) -> None:
        """Upload ``path`` to ``key`` and verify the stored object (size + sha256)."""
        self.store.put_file(key, path)
        if not self.store.verify_file(key, path, sha, size):
            raise StoreError(f"{self.store.uri(key)}: stored object does not match sha256 {sha[:12]}.. / size {size}")

    def _put_manifest(self, key: str, data: bytes) -> None:
        self.store.put_bytes(key, data)
        if self.store.get_bytes(key) != data:
            raise StoreError(f"{self.store.uri(key)}: manifest read back differs from what was written")


__all__ = ["CheckpointUploader"]
