"""A full disk is a wait, not a failure: ``DiskFull`` and how a failed write is recognised.

A write that fails for lack of space (``OSError`` ENOSPC or EDQUOT, safetensors'
``SafetensorError: ... No space left on device (os error 28)``, torch's stream writer
failing on a disk with almost no room left) becomes :class:`DiskFull`, naming the
paths the writer uses and the bytes free on each. The trainer process raises it across
its RPC (``gpu_runtime.trainer.server`` wraps every method with :func:`guarded`); the
node agent turns it into the ``DiskFull`` failure and a ``disk_full`` event, and the
run waits for space (``workflows.disk_wait``).

Tests make a checkpoint fail with a real ENOSPC through ``MILESTONE_FAULT_ENOSPC``
(``gpu_runtime.proc.faults``).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)
A = TypeVar("A")
R = TypeVar("R")
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
NO_SPACE_TEXT = ("No space left on device", "Disk quota exceeded", f"os error {errno.ENOSPC}")
# torch's stream writer reports a short write without its errno ("unexpected pos ..."): such an error
# counts as a full disk when one of the writer's paths has less than this left
TORCH_WRITER_TEXT = ("inline_container", "PytorchStreamWriter")
LOW_SPACE_BYTES = 64 << 20


class DiskFull(OSError):
    """A write failed for lack of space; the message names each path and its free bytes."""


def free_bytes(path: Path) -> int | None:
    """Bytes free to an unprivileged writer on the filesystem holding ``path`` (its nearest
    existing ancestor); None when none can be read."""
    p = Path(path).absolute()
    for candidate in (p, *p.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def is_no_space(err: BaseException, paths: Iterable[Path] = ()) -> bool:
    """Whether ``err`` is a write that failed for lack of space."""
    if isinstance(err, OSError) and err.errno in NO_SPACE_ERRNOS:
        return True
    text = str(err)
    if type(err).__name__ == "SafetensorError" or isinstance(err, OSError):
        return any(t in text for t in NO_SPACE_TEXT)
    if isinstance(err, RuntimeError) and any(t in text for t in TORCH_WRITER_TEXT):
        return any((free := free_bytes(p)) is not None and free < LOW_SPACE_BYTES for p in paths)
    return False


def describe_space(paths: Iterable[Path]) -> str:
    """``<path> has <n> bytes free`` for each path (each filesystem once)."""
    seen: set[int | None] = set()
    parts = []
    for p in paths:
        free = free_bytes(p)
        key = _device(p)
        if key in seen and key is not None:
            continue
        seen.add(key)
        parts.append(f"{p} has {free if free is not None else 'unknown'} bytes free")
    return "; ".join(parts)


def _device(path: Path) -> int | None:
    p = Path(path).absolute()
    for candidate in (p, *p.parents):
        try:
            return candidate.stat().st_dev
        except OSError:
            continue
    return None


def disk_full(err: BaseException, paths: Iterable[Path]) -> DiskFull | None:
    """``err`` as a ``DiskFull`` naming the failed file (when it says) and ``paths``, or None
    when it is not a failure for lack of space."""
    paths = list(paths)
    if not is_no_space(err, paths):
        return None
    filename = getattr(err, "filename", None)
    where = [Path(filename)] if isinstance(filename, str | os.PathLike) else []
    message = f"no space left on device ({type(err).__name__}: {err}): {describe_space([*where, *paths])}"
    return DiskFull(errno.ENOSPC, message)


def guarded(fn: Callable[[A], R], paths: Callable[[], Iterable[Path]]) -> Callable[[A], R]:
    """``fn`` whose failures for lack of space are raised as ``DiskFull`` (``paths``: where
    the caller writes, probed for their free bytes when it fails)."""

    @functools.wraps(fn)
    def call(arg: A) -> R:
        try:
            return fn(arg)
        except DiskFull:
            raise
        except Exception as err:
            full = disk_full(err, paths())
            if full is None:
                raise
            log.warning("%s", full)
            raise full from err

    return call

