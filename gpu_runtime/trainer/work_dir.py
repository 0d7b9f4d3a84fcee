"""Where the trainer process keeps a run's files under its ``--work-dir``.

``<work_dir>/<run_id>/``: everything of one run (exported versions, local checkpoints,
the dataset, the base model folder, a fork's ancestors' checkpoints); the node reclaims
it when the run has closed (``gpu_runtime.node.reclaim``). Beside the runs' folders,
``TrainerService`` saves and restores checkpoints through temporary folders
(``TEMP_NAME``), removed when the call ends, and at the next process start when the
process was killed inside one.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

log = logging.getLogger(__name__)
# TrainerService's tempfile.mkdtemp folders: its prefix (restore-, save-) and tempfile's 8 characters
TEMP_NAME = re.compile(r"(restore|save)-[a-z0-9_]{8}")
RUN_ENTRIES = ("checkpoints", "weights", "dataset.jsonl")  # a run's folder has one of these; a temporary one none


def run_folder(work_dir: Path, run_id: str) -> Path:
    """Everything the trainer process (``--work-dir work_dir``) keeps for ``run_id``."""
    return Path(work_dir) / run_id


def weights_folder(work_dir: Path, run_id: str, version: int) -> Path:
    """Where the trainer process (``--work-dir work_dir``) exports a version's model folder.
    The node agent links a version it pushes to its engines from there (same disk, no copy)."""
    return run_folder(work_dir, run_id) / "weights" / f"v{version:06d}"


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
