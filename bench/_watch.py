"""What a benchmarked run writes and how much memory its processes hold, watched from outside.

``Watch`` runs one thread that, every ``interval_s``:

- walks the given folders (a file:// store, a node's work dir) and keeps a ledger of every
  file it has seen: the largest size seen, the kind of bytes (from its path, through a
  ``classify`` function) and when it was written (its mtime when first seen). Files are
  counted where they land: a path with a part that starts with ``.`` or ends with ``.tmp``,
  ``.download``, ``.part`` or ``.old`` (what the project writes before renaming it into place)
  is skipped, and a hard link (``st_nlink > 1``) to a file counted at this scan or the one
  before, unmodified since (an engine's folder linked to the trainer's export), adds nothing.
  A path rewritten as a new file (a new inode) counts again, and so does a file written over
  in place under a new name (an export over a pruned version's file: a new mtime). A file
  written and deleted between two scans is missed;
- reads each watched process's ``VmHWM`` (the kernel's peak resident set, exact) and, through
  psutil, its resident set and ``write_bytes`` (bytes it sent to the storage layer). The pids
  come from a function called each time, so processes started during the run (a node's
  trainer and engines) join when they appear.

``Watch.__exit__`` takes a last sample, so the last values are those just before the
processes are stopped.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

# (kind, where) of a file from its path relative to the watched root; None: not counted
Classify = Callable[[tuple[str, ...]], tuple[str, str] | None]


@dataclass
class FileSeen:
    kind: str
    where: str
    size: int
    written: float  # its mtime when first seen (time.time() clock): when it was written, not when the scan came


@dataclass
class ProcSeen:
    role: str
    pid: int
    peak_rss: int = 0  # max of VmHWM and the sampled RSS, bytes
    write_bytes: int = 0  # /proc/<pid>/io write_bytes at the last sample


TRANSIENT_SUFFIXES = (".tmp", ".download", ".part", ".old")
KEPT_DOT_NAMES = frozenset({".versions"})  # a node's version folders (gpu_runtime.trainer.work_dir.versions_root)


def transient(parts: tuple[str, ...]) -> bool:
    """A path under a name the project writes before renaming it into place."""
    return any((p.startswith(".") and p not in KEPT_DOT_NAMES) or p.endswith(TRANSIENT_SUFFIXES) for p in parts)


@dataclass
class Ledger:
    files: list[FileSeen] = field(default_factory=list)
    _by_path: dict[Path, tuple[int, FileSeen]] = field(default_factory=dict)
    _last_inodes: set[tuple[int, int]] = field(default_factory=set)  # (inode, mtime_ns)

    def scan(self, roots: list[tuple[Path, Classify]]) -> None:
        now, inodes = time.time(), set()
        for root, classify in roots:
            for path, st in _walk(root):
                known = self._by_path.get(path)
                if known is not None and known[0] == st.st_ino:
                    known[1].size = max(known[1].size, st.st_size)
                elif st.st_nlink > 1 and ((same := (st.st_ino, st.st_mtime_ns)) in self._last_inodes or same in inodes):
                    self._by_path[path] = (st.st_ino, FileSeen("link", "", 0, now))  # not in files: no bytes
                else:
                    parts = path.relative_to(root).parts
                    kind = None if transient(parts) else classify(parts)
                    if kind is None:
                        continue
                    seen = FileSeen(kind[0], kind[1], st.st_size, min(now, st.st_mtime))
                    self.files.append(seen)
                    self._by_path[path] = (st.st_ino, seen)
                inodes.add((st.st_ino, st.st_mtime_ns))
        self._last_inodes = inodes

    def bytes_by_kind(self, start: float = 0.0, end: float = float("inf")) -> dict[tuple[str, str], int]:
        """Bytes of the files written in [start, end) (their mtime when first seen), by (kind, where)."""
        out: dict[tuple[str, str], int] = {}
        for f in self.files:
            if start <= f.written < end:
                out[(f.kind, f.where)] = out.get((f.kind, f.where), 0) + f.size
        return out


def _walk(root: Path):
    stack = [root]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:  # removed meanwhile
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(Path(e.path))
                elif e.is_file(follow_symlinks=False):
                    yield Path(e.path), e.stat(follow_symlinks=False)
            except OSError:
                continue


def vm_hwm(pid: int) -> int:
    """The kernel's peak resident set of ``pid`` in bytes (0: gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Watch:
    """``with Watch(roots, pids) as w:`` samples until the block ends; then ``w.ledger`` and
    ``w.procs`` (role -> ProcSeen). ``pids()`` returns {role: pid} (roles stay unique)."""

    def __init__(self, roots: list[tuple[Path, Classify]], pids: Callable[[], dict[str, int]] = dict,
                 interval_s: float = 0.1) -> None:
        self.roots, self.pids, self.interval_s = roots, pids, interval_s
        self.ledger = Ledger()
        self.procs: dict[str, ProcSeen] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="watch", daemon=True)

    def sample(self) -> None:
        self.ledger.scan(self.roots)
        for role, pid in self.pids().items():
            seen = self.procs.get(role)
            if seen is None or seen.pid != pid:  # a restarted process keeps the larger peak under its role
                seen = self.procs[role] = ProcSeen(role, pid, seen.peak_rss if seen else 0)
            try:
                p = psutil.Process(pid)
                rss, wb = p.memory_info().rss, p.io_counters().write_bytes
            except (psutil.Error, OSError):
                continue
            seen.peak_rss = max(seen.peak_rss, rss, vm_hwm(pid))
            seen.write_bytes = wb

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> Watch:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
