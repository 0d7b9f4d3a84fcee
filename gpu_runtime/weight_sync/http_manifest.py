"""What a version folder holds, hash by hash: the manifest the pull path checks every byte against.

A rollout node on another machine pulls a policy version from the trainer's node
(``http_server.WeightServer`` serves, ``http_pull.pull_version`` fetches). The server
describes the version's model folder once (``build_manifest``, cached per version):

- every file with its ``path`` (relative, ``/``-separated; nested folders such as a LoRA
  ``adapter/`` keep their place) and ``size``;
- a ``.safetensors`` file with its header's length and sha256 and, per tensor, its name,
  dtype, shape, byte range in the file (``start``/``end``, absolute) and the sha256 of
  those bytes. The header and the tensors cover the file, so no whole-file hash is kept
  for it: the puller checks each tensor as its bytes arrive and names the one that differs;
- any other file with the sha256 of its bytes.

``segments`` turns one file's entry into the byte ranges a puller hashes, in file order,
and refuses an entry whose ranges leave a byte unchecked.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAFETENSORS_SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
_READ_BYTES = 1 << 20
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


class BufferPool:
    """Large byte buffers kept for the next pull or manifest: a fresh buffer's pages cost
    their first touch (slow on a VM: ~1 GB/s), a kept one's do not. Up to ``keep`` per size."""

    def __init__(self, nbytes: int, keep: int) -> None:
        self.nbytes, self.keep = nbytes, keep
        self._kept: dict[int, list[memoryview]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int | None = None) -> memoryview:
        nbytes = nbytes or self.nbytes
        with self._lock:
            kept = self._kept.get(nbytes)
            if kept:
                return kept.pop()
        return memoryview(bytearray(nbytes))

    def give(self, buf: memoryview) -> None:
        with self._lock:
            kept = self._kept.setdefault(len(buf), [])
            if len(kept) < self.keep:
                kept.append(buf)


BUFFERS = BufferPool(_READ_BYTES, keep=64)  # the pull's buffers and the manifest's, 1 MiB each


class ManifestError(ValueError):
    """A manifest or a safetensors header that does not describe its file."""


@dataclass(frozen=True)
class Segment:
    """One byte range of a file and the sha256 its bytes must have; ``what`` names it in errors
    (``tensor model.norm.weight of model.safetensors``)."""

    what: str
    start: int
    end: int
    sha256: str


def read_safetensors_header(fd: int, size: int, name: str) -> tuple[int, dict[str, dict[str, Any]]]:
    """(the bytes before the tensor data: 8 + the JSON header's length, the tensors by name with
    their dtype, shape and absolute ``start``/``end``), from an open file of ``size`` bytes.
    safetensors: an 8-byte little-endian header length, the JSON header, the data; a tensor's
    ``data_offsets`` count from the data's start."""
    if size < 8:
        raise ManifestError(f"{name}: {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise ManifestError(f"{name}: header length {n} does not fit the file ({size} bytes)")
    try:
        header = json.loads(os.pread(fd, n, 8))
    except ValueError as err:
        raise ManifestError(f"{name}: header is not JSON: {err}") from None
    base = 8 + n
    tensors: dict[str, dict[str, Any]] = {}
    for tname, info in header.items():
        if tname == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        if not 0 <= lo <= hi or base + hi > size:
            raise ManifestError(f"{name}: tensor {tname} data_offsets {[lo, hi]} outside the file ({size} bytes)")
        tensors[tname] = {"dtype": info["dtype"], "shape": list(info["shape"]), "start": base + lo, "end": base + hi}
    return base, tensors


def _sha256_range(fd: int, start: int, end: int) -> str:
    """sha256 of bytes [start, end) of an open file, read in large pieces into one buffer
    (``preadv``: no copy per piece; hashlib releases the GIL, so tensors hash in parallel)."""
    h = hashlib.sha256()
    buf = BUFFERS.take()
    try:
        pos = start
        while pos < end:
            want = min(len(buf), end - pos)
            got = os.preadv(fd, [buf[:want]], pos)
            if got <= 0:
                raise ManifestError(f"file ended at byte {pos}, expected {end}")
            h.update(buf[:got])
            pos += got
    finally:
        BUFFERS.give(buf)
    return h.hexdigest()


def _file_entry(folder: Path, rel: str, pool: ThreadPoolExecutor) -> dict[str, Any]:
    path = folder / rel
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if not rel.endswith(SAFETENSORS_SUFFIX):
            return {"path": rel, "size": size, "sha256": _sha256_range(fd, 0, size)}
        base, tensors = read_safetensors_header(fd, size, rel)
        names = sorted(tensors, key=lambda t: (tensors[t]["start"], tensors[t]["end"]))
        hashes = list(pool.map(lambda t: _sha256_range(fd, tensors[t]["start"], tensors[t]["end"]), names))
        entry = {"path": rel, "size": size, "header_size": base, "header_sha256": _sha256_range(fd, 0, base),
                 "tensors": [{"name": t, **tensors[t], "sha256": h} for t, h in zip(names, hashes, strict=True)]}
    finally:
        os.close(fd)
    segments(entry)  # refuse a file whose tensors leave bytes unchecked (holes, overlaps, a tail)
    return entry


def build_manifest(folder: Path, run_id: str, version: int, checksum: str) -> dict[str, Any]:
    """The manifest of the version folder ``folder`` (every file under it, small files first,
    ``.safetensors`` last; tensors hashed on a few threads)."""
    rels = sorted((p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()),
                  key=lambda r: (r.endswith(SAFETENSORS_SUFFIX), r))
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="manifest") as pool:
        files = [_file_entry(folder, rel, pool) for rel in rels]
    return {"run_id": run_id, "version": version, "checksum": checksum, "files": files}


def segments(entry: dict[str, Any]) -> list[Segment]:
    """The byte ranges of one manifest file entry, in file order, that together cover it
    exactly (``ManifestError`` otherwise: a puller never writes a byte it did not check)."""
    path, size = entry["path"], int(entry["size"])
    if "tensors" not in entry:
        return [Segment(path, 0, size, entry["sha256"])]
    segs = [Segment(f"header of {path}", 0, int(entry["header_size"]), entry["header_sha256"])]
    for t in sorted(entry["tensors"], key=lambda t: (t["start"], t["end"])):
        segs.append(Segment(f"tensor {t['name']} of {path}", int(t["start"]), int(t["end"]), t["sha256"]))
    pos = 0
    for s in segs:
        if s.start != pos or s.end < s.start:
            raise ManifestError(f"{path}: {s.what} covers bytes [{s.start}, {s.end}), expected it to start at {pos}")
        pos = s.end
    if pos != size:
        raise ManifestError(f"{path}: header and tensors end at byte {pos}, the file has {size}")
    return segs


def check_header(fd: int, entry: dict[str, Any]) -> None:
    """The safetensors header of a pulled file (its bytes already checked against the
    manifest) lists the manifest's tensors: the per-tensor hashes were for those tensors."""
    base, tensors = read_safetensors_header(fd, int(entry["size"]), entry["path"])
    listed = {t["name"]: {k: t[k] for k in ("dtype", "shape", "start", "end")} for t in entry["tensors"]}
    if base != entry["header_size"] or tensors != listed:
        differ = sorted(set(tensors).symmetric_difference(listed)) or sorted(
            n for n in tensors if tensors[n] != listed.get(n))
        raise ManifestError(f"{entry['path']}: header does not list the manifest's tensors (differ: {differ[:5]})")


def empty_segments(segs: list[Segment]) -> Iterator[Segment]:
    """The zero-byte segments whose expected hash is not the empty input's (no bytes to wait for)."""
    return (s for s in segs if s.start == s.end and s.sha256 != _EMPTY_SHA256)
