"""Object stores addressed by URI: ``file:///abs/dir`` or ``s3://bucket/prefix``.

Keys are ``/``-separated relative paths. Writes are atomic for readers: the local
backend writes a temp file and renames it; S3 puts are atomic by nature.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path


class StoreError(RuntimeError):
    """A store operation failed (retryable: the store may be back later)."""


class ObjectStore(ABC):
    root_uri: str

    @abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """All keys under ``prefix`` (recursive), sorted."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    def put_file(self, key: str, path: str | Path) -> None:
        self.put_bytes(key, Path(path).read_bytes())

    def get_file(self, key: str, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        tmp.write_bytes(self.get_bytes(key))
        os.replace(tmp, path)

    def delete_prefix(self, prefix: str) -> None:
        for key in self.list(prefix):
            self.delete(key)

    def update(self, key: str, fn: Callable[[bytes | None], bytes | None]) -> None:
        """Replace ``key``'s content (``None``: absent) with ``fn(content)``, atomically
        against other ``update`` calls on the key; ``fn`` returns ``None`` to leave it.
        Backends make it a compare-and-swap; this default is not atomic."""
        try:
            old: bytes | None = self.get_bytes(key)
        except KeyError:
            old = None
        new = fn(old)
        if new is not None:
            self.put_bytes(key, new)

    def uri(self, key: str) -> str:
        return f"{self.root_uri.rstrip('/')}/{key}"

    def verify_file(self, key: str, path: str | Path, sha256: str, size: int) -> bool:
        """True when the stored object ``key`` has this size and sha256 (``path`` is the
        local source, which backends may use for a cheaper check). Default: re-read."""
        try:
            data = self.get_bytes(key)
        except KeyError:
            return False
        return len(data) == size and hashlib.sha256(data).hexdigest() == sha256



class ForwardingStore(ObjectStore):
    """A store that hands every read and write to ``inner``; subclasses override the
    operations they guard or record (``delete_prefix`` and ``update`` keep the base
    class's composition of the forwarded operations unless overridden)."""

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner
        self.root_uri = inner.root_uri

    def put_bytes(self, key: str, data: bytes) -> None:
        self.inner.put_bytes(key, data)

    def put_file(self, key: str, path: str | Path) -> None:
        self.inner.put_file(key, path)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def get_bytes(self, key: str) -> bytes:
        return self.inner.get_bytes(key)

    def get_file(self, key: str, path: str | Path) -> None:
        self.inner.get_file(key, path)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str) -> list[str]:
        return self.inner.list(prefix)

    def verify_file(self, key: str, path: str | Path, sha256: str, size: int) -> bool:
        return self.inner.verify_file(key, path, sha256, size)

def file_sha256(path: str | Path, chunk: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or ".." in key.split("/"):
        raise ValueError(f"invalid store key {key!r}")
    return key


class LocalStore(ObjectStore):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.root_uri = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def put_bytes(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def put_file(self, key: str, path: str | Path) -> None:
        dst = self._path(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.")
        os.close(fd)
        try:
            shutil.copyfile(path, tmp)
            os.replace(tmp, dst)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise KeyError(key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix if prefix else self.root
        if base.is_file():
            return [prefix]
        if not base.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root))
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(".")
        )

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def update(self, key: str, fn: Callable[[bytes | None], bytes | None], lock_timeout_s: float = 30.0) -> None:
        """Under an exclusive ``flock`` on ``.<name>.lock`` next to the key (readers
        are not blocked: the write itself is an atomic rename)."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + lock_timeout_s
        with open(path.with_name(f".{path.name}.lock"), "a") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StoreError(f"{self.uri(key)}: lock held for over {lock_timeout_s:.0f}s") from None
                    time.sleep(0.05)
            try:
                old = path.read_bytes() if path.is_file() else None
                new = fn(old)
                if new is not None:
                    self.put_bytes(key, new)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def verify_file(self, key: str, path: str | Path, sha256: str, size: int) -> bool:
        stored = self._path(key)
        try:
            if stored.stat().st_size != size:
                return False
            return file_sha256(stored) == sha256
        except FileNotFoundError:
            return False

