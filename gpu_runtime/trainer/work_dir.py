"""Where the trainer process keeps a run's files under its ``--work-dir``.

``<work_dir>/<run_id>/``: everything of one run (exported versions, local checkpoints,
the dataset, the base model folder, a fork's ancestors' checkpoints); the node reclaims
it when the run has closed (``gpu_runtime.node.reclaim``). Beside the runs' folders,
the trainer process saves and restores checkpoints through temporary folders
(``TEMP_NAME``: ``TrainerDefaults.state_writer``'s, ``VersionBuilder``'s), removed when
the call ends, and at the next process start when the process was killed inside one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)
# the trainer process's tempfile.mkdtemp folders: its prefix (restore-, save-) and tempfile's 8 characters
TEMP_NAME = re.compile(r"(restore|save)-[a-z0-9_]{8}")
RUN_ENTRIES = ("checkpoints", "weights", "dataset.jsonl")  # a run's folder has one of these; a temporary one none
VERSIONS_ENV = "MILESTONE_VERSIONS_DIR"


def run_folder(work_dir: Path, run_id: str) -> Path:
    """Everything the trainer process (``--work-dir work_dir``) keeps for ``run_id``."""
    return Path(work_dir) / run_id


def versions_root(work_dir: Path) -> Path:
    """Where the node whose trainer process has ``--work-dir work_dir`` keeps the version
    folders of its runs: the trainer's work dir (``<work_dir>/.versions``: a dot name, never
    a run's folder), or
    ``$MILESTONE_VERSIONS_DIR/<tag>`` when set (a tmpfs such as ``/dev/shm``: the versions in
    RAM; ``<tag>`` names the node by a hash of ``work_dir``, so the trainer process and the
    node agent find the same folder). On this machine (a VM whose fresh memory pages are
    slow to fault in) RAM was slower than the disk's page cache: 24.3 s vs 15.9 s per train
    phase at 0.36B (``bench.bench_scale``; docs/cost-per-step.md)."""
    work_dir = Path(work_dir).absolute()
    chosen = os.environ.get(VERSIONS_ENV, "")
    if not chosen or chosen == "disk":
        return work_dir / ".versions"
    return Path(chosen) / ("milestone-versions-" + hashlib.sha256(str(work_dir).encode()).hexdigest()[:12])


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
