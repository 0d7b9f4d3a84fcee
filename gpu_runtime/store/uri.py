"""Open an object store from its URI: ``file:///abs/dir``, a plain path, or ``s3://bucket/prefix``."""

from __future__ import annotations

from urllib.parse import urlparse

from gpu_runtime.store.object_store import LocalStore, ObjectStore
from gpu_runtime.store.s3 import S3Store


def open_store(uri: str) -> ObjectStore:
    """``file:///abs``, a plain path, or ``s3://bucket/prefix`` (see ``gpu_runtime.store.s3``)."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        path = parsed.path if parsed.scheme == "file" else uri
        if parsed.scheme == "file" and parsed.netloc:
            path = parsed.netloc + parsed.path  # file://relative/dir
        return LocalStore(path)
    if parsed.scheme == "s3":
        return S3Store.from_uri(uri)
    raise ValueError(f"unsupported store URI {uri!r}: use file:// or s3://")
