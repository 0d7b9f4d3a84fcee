"""Where the trainer process keeps a run's files under its ``--work-dir``.

``<work_dir>/<run_id>/``: everything of one run (exported versions, local checkpoints,
the dataset, the base model folder, a fork's ancestors' checkpoints); the node reclaims
it when the run has closed (``gpu_runtime.node.reclaim``). Beside the runs' folders,
``TrainerService`` saves and restores checkpoints through temporary folders
(``TEMP_NAME``), removed when the call ends, and at the next process start when the
process was killed inside one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)
# TrainerService's tempfile.mkdtemp folders: its prefix (restore-, save-) and tempfile's 8 characters
TEMP_NAME = re.compile(r"(restore|save)-[a-z0-9_]{8}")
RUN_ENTRIES = ("checkpoints", "weights", "dataset.jsonl")  # a run's folder has one of these; a temporary one none
VERSIONS_ENV = "MILESTONE_VERSIONS_DIR"
MIN_TMPFS_BYTES = 4 << 30


def run_folder(work_dir: Path, run_id: str) -> Path:
    """Everything the trainer process (``--work-dir work_dir``) keeps for ``run_id``."""
    return Path(work_dir) / run_id


def versions_root(work_dir: Path) -> Path:
    """Where the node whose trainer process has ``--work-dir work_dir`` keeps the version
    folders of its runs: in RAM when it can (a version is exported every step and read by
    the engines right away; on a disk it cost the step a model's size of writes, ~10 s per
    step at 0.36B on this machine's disk, measured by ``bench.bench_scale``).

    ``$MILESTONE_VERSIONS_DIR`` when set (``disk``: the trainer's work dir), else ``/dev/shm``
    when it is a tmpfs of at least ``MIN_TMPFS_BYTES`` (a container's default 64 MB is not:
    ``--shm-size``), else the trainer's work dir. One folder per node (named by a hash of
    ``work_dir``), so the trainer process and the node agent find the same one."""
    work_dir = Path(work_dir).absolute()
    tag = "milestone-versions-" + hashlib.sha256(str(work_dir).encode()).hexdigest()[:12]
    chosen = os.environ.get(VERSIONS_ENV, "")
    if chosen == "disk":
        return work_dir / "versions"
    if chosen:
        return Path(chosen) / tag
    shm = Path("/dev/shm")
    try:
        st = os.statvfs(shm)
        big = st.f_blocks * st.f_frsize >= MIN_TMPFS_BYTES and os.access(shm, os.W_OK)
    except OSError:
        big = False
    return shm / tag if big else work_dir / "versions"


def run_versions(work_dir: Path, run_id: str) -> Path:
    """A run's version folders on the node (``versions_root``): ``trainer/v<N>`` the trainer's
    exports, ``engines/v<N>`` what the engines were given (hard links to an export, or a
    download), ``upload/v<N>`` a checkpoint's version on its way to the store (hard links)."""
    return versions_root(work_dir) / run_id


def weights_folder(work_dir: Path, run_id: str, version: int) -> Path:
    """Where the trainer process (``--work-dir work_dir``) exports a version's model folder.
    The node agent links a version it pushes to its engines from there (same filesystem, no copy)."""
    return run_versions(work_dir, run_id) / "trainer" / f"v{version:06d}"


def engine_weights_folder(work_dir: Path, run_id: str, version: int) -> Path:
    """The folder of ``version`` the node's engines load (``work_dir``: the trainer's)."""
    return run_versions(work_dir, run_id) / "engines" / f"v{version:06d}"


def upload_weights_folder(work_dir: Path, run_id: str, version: int) -> Path:
    """Hard links to ``version``'s export while its checkpoint uploads it."""
    return run_versions(work_dir, run_id) / "upload" / f"v{version:06d}"


def is_temp_dir(path: Path) -> bool:
    """A save's or restore's temporary folder (not the folder of a run with such a name)."""
    return (path.is_dir() and TEMP_NAME.fullmatch(path.name) is not None
            and not any((path / entry).exists() for entry in RUN_ENTRIES))


def remove_temp_dirs(work_dir: Path) -> None:
    """At a trainer process's start: the temporary folders a killed predecessor left (no call
    of this process can be using them yet)."""
    if not Path(work_dir).is_dir():
        return
    for p in sorted(Path(work_dir).iterdir()):
        if is_temp_dir(p):
            log.info("removing %s, left by a trainer process that was stopped inside a call", p)
            shutil.rmtree(p, ignore_errors=True)
