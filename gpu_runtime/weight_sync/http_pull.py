"""A rollout node's side of the pull path: one policy version fetched from the trainer's node.

``pull_version`` asks a ``http_server.WeightServer`` for the version's manifest, then
streams every file into a temporary folder beside ``dst`` and renames it to ``dst`` once
every byte checked out: ``dst`` holds a whole, verified version or nothing.

Checked as the bytes arrive: each tensor of a ``.safetensors`` file, its header, and
every other file, against the manifest's sha256 (a mismatch names the tensor or file and
stops the pull); then each safetensors header against the manifest's tensor list, and
``milestone.json`` against the version and checksum asked for. The engines' checksum gate
still checks the whole version after they load it.

Fast by keeping the three jobs apart: this thread only reads the socket, into
preallocated buffers (``readinto``: the kernel copies into them, nothing else does); a
writer thread ``pwrite``s each buffer; a few hasher threads hash its pieces (a tensor's
pieces in order on one thread, different tensors on different threads). A buffer is
reused once written and hashed. ``bench/bench_weight_pull.py`` measures it against raw TCP.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import queue
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote, urlsplit

from gpu_runtime.models.model_folder import read_meta
from gpu_runtime.models.safetensors_file import Spares
from gpu_runtime.proc.auth import bearer_headers
from gpu_runtime.weight_sync.http_manifest import (
    BUFFERS,
    SAFETENSORS_SUFFIX,
    ManifestError,
    Segment,
    check_header,
    empty_segments,
    segments,
)
from gpu_runtime.weight_sync.http_server import API_PREFIX

# 1 MiB reads, 32 in flight (32 MiB a pull, kept between pulls): a buffer the socket filled is
# still in cache when the writer and a hasher read it (8 MiB ones were ~40% slower at 0.36B)
CHUNK_BYTES = BUFFERS.nbytes
CHUNKS = 32


class WeightPullError(RuntimeError):
    """A pull that did not complete: the server unreachable, the connection lost, a timeout."""


class PullRefused(WeightPullError):
    """The server answered with an error (``status``: 401, 404, 409, ...)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class PullVerificationError(WeightPullError):
    """Bytes that are not the version's: a tensor or file whose sha256 differs from the
    manifest's, a header that lists other tensors, a ``milestone.json`` for another version."""


@dataclass(frozen=True)
class PullStats:
    """What one pull moved: ``bytes`` over all ``files``, in ``seconds`` (manifest included)."""

    bytes: int
    seconds: float
    files: int

    @property
    def gb_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else 0.0


def pull_version(
    url: str, run_id: str, version: int, checksum: str, dst: Path, token: str | None = None,
    timeout_s: float = 60.0, *, resolve_timeout_s: float = 1800.0, chunk_bytes: int = CHUNK_BYTES,
    hashers: int | None = None, spares: Spares | None = None,
) -> PullStats:
    """Fetch version ``version`` (``checksum``) of ``run_id`` from the weight server at ``url``
    into the folder ``dst`` (replaced if it exists; nothing is left there when the pull fails).
    ``timeout_s``: connecting and each read of the transfer; ``resolve_timeout_s``: the manifest's
    answer, which waits while the trainer's node exports the version; ``hashers``: hashing
    threads (default: up to 4, one per CPU); ``spares``: where this node keeps the weights files
    of pruned versions (``model_folder.spares_for``): a ``.safetensors`` file is written over
    one of them (pages already allocated) instead of into a new file, as the trainer's export is."""
    dst = Path(dst)
    t0 = time.perf_counter()
    where = f"weights v{version} of run {run_id} from {url}"
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"weight server url {url!r}: expected http://host:port")
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
    base = f"{API_PREFIX}{quote(run_id, safe='')}/{version}"
    query = f"?checksum={quote(checksum, safe='')}"
    headers = bearer_headers(token)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.pull-{uuid.uuid4().hex[:12]}"  # not v*: a version pruner passes it by
    tmp.mkdir()
    try:
        conn.connect()
        conn.sock.settimeout(resolve_timeout_s)
        manifest = _manifest(conn, f"{base}/manifest{query}", headers, where)
        if (manifest.get("run_id"), manifest.get("version"), manifest.get("checksum")) != (run_id, version, checksum):
            raise PullVerificationError(f"{where}: the manifest is for run {manifest.get('run_id')} "
                                        f"v{manifest.get('version')} checksum {manifest.get('checksum')}")
        conn.sock.settimeout(timeout_s)
        total = 0
        with _Pipeline(chunk_bytes, CHUNKS, hashers or min(4, os.cpu_count() or 1)) as pipe:
            for entry in manifest["files"]:
                rel = _relpath(entry["path"], where)
                total += _pull_file(conn, f"{base}/files/{quote(rel)}{query}", headers, entry, tmp / rel, pipe, where,
                                    spares if rel.endswith(SAFETENSORS_SUFFIX) else None)
        _check_folder(tmp, manifest, version, checksum, where)
        _install(tmp, dst)
        return PullStats(bytes=total, seconds=time.perf_counter() - t0, files=len(manifest["files"]))
    except (http.client.HTTPException, OSError) as err:
        raise WeightPullError(f"{where}: {type(err).__name__}: {err}") from err
    except ManifestError as err:
        raise PullVerificationError(f"{where}: {err}") from err
    finally:
        conn.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _manifest(conn: http.client.HTTPConnection, path: str, headers: dict[str, str], where: str) -> dict[str, Any]:
    conn.request("GET", path, headers=headers)
    resp = conn.getresponse()
    body = resp.read()
    _refused(resp, body, where, "manifest")
    try:
        manifest = json.loads(body)
        for entry in manifest["files"]:
            segments(entry)
        return manifest
    except (ValueError, KeyError, TypeError) as err:
        raise PullVerificationError(f"{where}: the manifest does not parse: {err}") from None


def _refused(resp: http.client.HTTPResponse, body: bytes, where: str, what: str) -> None:
    if resp.status == 200:
        return
    try:
        reason = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        reason = body[:500].decode(errors="replace")
    raise PullRefused(f"{where}: {what}: HTTP {resp.status}: {reason}", resp.status)


def _relpath(rel: str, where: str) -> str:
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or any(part in ("", ".", "..") for part in rel.split("/")):
        raise PullVerificationError(f"{where}: the manifest names a file outside the folder: {rel!r}")
    return p.as_posix()


def _pull_file(conn: http.client.HTTPConnection, path: str, headers: dict[str, str], entry: dict[str, Any],
               out: Path, pipe: _Pipeline, where: str, spares: Spares | None) -> int:
    """Stream one file into ``out`` (over a spare file when ``spares`` holds one), hashing it
    segment by segment; returns its size."""
    rel, size = entry["path"], int(entry["size"])
    segs = segments(entry)
    for s in empty_segments(segs):
        raise PullVerificationError(f"{where}: {s.what}: no bytes, but the manifest's sha256 is {s.sha256}")
    segs = [s for s in segs if s.end > s.start]
    conn.request("GET", path, headers=headers)
    resp = conn.getresponse()
    if resp.status != 200:
        _refused(resp, resp.read(), where, rel)
    length = resp.getheader("Content-Length")
    if length is None or int(length) != size:
        raise PullVerificationError(f"{where}: {rel}: the server sends {length} bytes, the manifest has {size}")
    out.parent.mkdir(parents=True, exist_ok=True)
    reused = spares is not None and spares.take(out)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | (0 if reused else os.O_TRUNC), 0o644)
    try:
        pipe.open_file(fd, segs, where)
        off, i = 0, 0
        while off < size:
            buf = pipe.take()
            n = _fill(resp, buf[:min(len(buf), size - off)], off, size, rel, where)
            while segs[i].end <= off:
                i += 1
            pipe.submit(buf, n, off, i)
            off += n
        if reused:
            os.ftruncate(fd, size)  # a longer spare's tail
    finally:
        try:
            pipe.close_file()  # every submitted chunk written and hashed (or skipped after a failure)
        finally:
            os.close(fd)
    return size


def _fill(resp: http.client.HTTPResponse, view: memoryview, off: int, size: int, rel: str, where: str) -> int:
    got = 0
    while got < len(view):
        n = resp.readinto(view[got:])
        if not n:
            raise WeightPullError(f"{where}: {rel}: the connection closed after {off + got} of {size} bytes")
        got += n
    return got


class _Pipeline:
    """A writer thread and ``hashers`` hasher threads over ``chunks`` reusable buffers; one
    file at a time (``open_file`` .. ``close_file``). The first failure (a mismatch, a
    write error) is kept in ``error`` and raised to the reading thread at its next call."""

    def __init__(self, chunk_bytes: int, chunks: int, hashers: int) -> None:
        self._free: queue.Queue[memoryview] = queue.Queue()
        self._bufs = [BUFFERS.take(chunk_bytes) for _ in range(chunks)]
        for buf in self._bufs:
            self._free.put(buf)
        self._writes: queue.Queue[tuple[memoryview, int, int] | None] = queue.Queue()
        self._hashes: list[queue.Queue[tuple[memoryview, int, int, int] | None]] = [
            queue.Queue() for _ in range(max(1, hashers))]
        self._cv = threading.Condition()
        self._refs: dict[int, int] = {}  # id(buffer) -> consumers left
        self.error: BaseException | None = None
        self._fd, self._where = -1, ""
        self._segs: list[Segment] = []
        self._threads = [threading.Thread(target=self._writer, name="pull-writer", daemon=True)] + [
            threading.Thread(target=self._hasher, args=(q,), name=f"pull-hasher-{k}", daemon=True)
            for k, q in enumerate(self._hashes)]

    def __enter__(self) -> _Pipeline:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._writes.put(None)
        for q in self._hashes:
            q.put(None)
        for t in self._threads:
            t.join()
        for buf in self._bufs:
            BUFFERS.give(buf)

    def open_file(self, fd: int, segs: list[Segment], where: str) -> None:
        self._fd, self._segs, self._where = fd, segs, where

    def take(self) -> memoryview:
        """A free buffer (blocks while all are in flight); raises the pipeline's failure."""
        buf = self._free.get()
        if self.error is not None:
            self._free.put(buf)
            raise self.error
        return buf

    def submit(self, buf: memoryview, n: int, off: int, first_seg: int) -> None:
        """Hand ``buf[:n]`` (the file's bytes from ``off``; ``first_seg``: the first segment it
        touches) to the writer and, piece by piece, to the hashers of the segments it covers."""
        pieces = []
        j = first_seg
        while j < len(self._segs) and self._segs[j].start < off + n:
            pieces.append(j)
            j += 1
        with self._cv:
            self._refs[id(buf)] = 1 + len(pieces)
        self._writes.put((buf, n, off))
        for j in pieces:
            self._hashes[j % len(self._hashes)].put((buf, n, off, j))

    def close_file(self) -> None:
        """Wait until every buffer came back; raise the failure if there was one."""
        with self._cv:
            self._cv.wait_for(lambda: not self._refs)
        if self.error is not None:
            raise self.error

    def _release(self, buf: memoryview) -> None:
        with self._cv:
            self._refs[id(buf)] -= 1
            if self._refs[id(buf)] == 0:
                del self._refs[id(buf)]
                self._free.put(buf)
                self._cv.notify_all()

    def _fail(self, err: BaseException) -> None:
        with self._cv:
            if self.error is None:
                self.error = err

    def _writer(self) -> None:
        while (item := self._writes.get()) is not None:
            buf, n, off = item
            try:
                if self.error is None:
                    done = 0
                    while done < n:
                        done += os.pwrite(self._fd, buf[done:n], off + done)
            except BaseException as err:  # noqa: BLE001 - handed to the reading thread (OSError: a full disk)
                self._fail(err)
            finally:
                self._release(buf)

    def _hasher(self, q: queue.Queue[tuple[memoryview, int, int, int] | None]) -> None:
        running: dict[int, Any] = {}  # segment index -> its sha256 so far (this file's)
        while (item := q.get()) is not None:
            buf, n, off, j = item
            try:
                seg = self._segs[j]
                if self.error is None:
                    lo, hi = max(seg.start, off), min(seg.end, off + n)
                    h = running.get(j)
                    if h is None or lo == seg.start:
                        h = running[j] = hashlib.sha256()
                    h.update(buf[lo - off:hi - off])
                    if hi == seg.end:
                        del running[j]
                        got = h.hexdigest()
                        if got != seg.sha256:
                            self._fail(PullVerificationError(
                                f"{self._where}: {seg.what}: sha256 {got} of bytes [{seg.start}, {seg.end}) "
                                f"differs from the manifest's {seg.sha256}"))
            except BaseException as err:  # noqa: BLE001 - handed to the reading thread
                self._fail(err)
            finally:
                self._release(buf)


def _check_folder(tmp: Path, manifest: dict[str, Any], version: int, checksum: str, where: str) -> None:
    for entry in manifest["files"]:
        if "tensors" in entry:
            fd = os.open(tmp / entry["path"], os.O_RDONLY)
            try:
                check_header(fd, entry)
            finally:
                os.close(fd)
    meta = read_meta(tmp)
    if meta.get("weight_version") != version or meta.get("checksum") != checksum:
        raise PullVerificationError(f"{where}: milestone.json names v{meta.get('weight_version')} with checksum "
                                    f"{meta.get('checksum')}, asked for v{version} with checksum {checksum}")


def _install(tmp: Path, dst: Path) -> None:
    """Rename the pulled folder to ``dst``; a folder already there is replaced whole."""
    if dst.exists():
        old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:12]}"
        os.replace(dst, old)
        os.replace(tmp, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dst)
