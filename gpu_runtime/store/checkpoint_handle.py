"""One checkpoint on its way to the store: what it holds, how its files are written and hashed,
and whether it is durable yet (``CheckpointStore`` owns the upload)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_runtime.store.object_store import file_sha256

# a writer fills an empty folder with the checkpoint's files (a trainer's state snapshot, written
# on the upload thread: the step that asked for the checkpoint does not wait for the disk)
Writer = Callable[[Path], None]


@dataclass
class CheckpointHandle:
    step: int
    local_path: Path
    files: dict[str, tuple[str, int]]  # relpath -> (sha256, size); filled by the upload thread for a writer
    meta: dict[str, Any]
    write: Writer | None = None  # files still to write into local_path (``CheckpointStore.save_written``)
    # a folder uploaded beside the checkpoint before its manifest (store prefix, local folder): the
    # version's model folder, so the store holds the weights of every durable checkpoint
    extra: tuple[str, Path] | None = None
    failures: int = 0
    last_error: BaseException | None = None
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    upload_seconds: float | None = None
    write_seconds: float | None = None  # the writer's time on the upload thread (logged with the commit)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _error: BaseException | None = field(default=None, repr=False)

    def wait(self, timeout: float | None = None) -> bool:
        """True once durable; False on timeout or failure (see ``error``)."""
        self._done.wait(timeout)
        return self.durable

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def durable(self) -> bool:
        return self._done.is_set() and self._error is None

    @property
    def error(self) -> BaseException | None:
        return self._error

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()


def copy_and_hash(src: Path, dst: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    dst.parent.mkdir(parents=True, exist_ok=True)
    with src.open("rb") as fi, dst.open("wb") as fo:
        while block := fi.read(8 << 20):
            h.update(block)
            fo.write(block)
            size += len(block)
    return h.hexdigest(), size


def file_hash(path: Path) -> tuple[str, int]:
    """(sha256, size) of a file: ``object_store.file_sha256`` and its size."""
    return file_sha256(path), path.stat().st_size


def hash_files(folder: Path) -> dict[str, tuple[str, int]]:
    """relpath -> (sha256, size) of every file under ``folder``."""
    return {p.relative_to(folder).as_posix(): file_hash(p) for p in sorted(folder.rglob("*")) if p.is_file()}
