"""A closed run's files on a node: which they are, and reclaiming them.

Under a node agent's ``--work-dir`` a run ``R`` keeps

- ``trainer/R/``: the trainer's exported versions, local checkpoints, dataset, base
  model folder and a fork's ancestors' checkpoints (``gpu_runtime.trainer.work_dir``);
- the run's version folders (``gpu_runtime.trainer.work_dir.run_versions``:
  ``trainer/.versions/R/``, or under ``$MILESTONE_VERSIONS_DIR``): the trainer's exports, the
  engines' copies (hard links) and a checkpoint's version on its way to the store;
- ``weights/R/``: where the engines' versions were kept before they moved there;
- ``data/runs_R_data_<split>.jsonl``: the dataset splits the rollouts read
  (``DatasetRows.rows``: the store key with ``/`` as ``_``).

Everything else there (``logs/``, ``children.json``) belongs to the node, not to a run.
Whether a run has closed is the caller's question (``workers.node_reclaim`` asks
Temporal); this module only finds and removes files. Each path is first renamed to a
``.reclaim-*`` name beside it (atomic), then removed, so a run that starts again on
this node at that moment writes into fresh folders, never into half-removed ones.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from pathlib import Path

from gpu_runtime.trainer.work_dir import is_temp_dir, run_folder, run_versions, versions_root

log = logging.getLogger(__name__)
TRASH_PREFIX = ".reclaim-"
# DatasetRows.rows: the key runs/<run>/data/<split>.jsonl with "/" as "_" (a split has no "_")
DATA_FILE = re.compile(r"runs_(?P<run>.+)_data_(?P<split>[^_/]+)\.jsonl")


def trainer_dir(work_dir: Path) -> Path:
    """The node's trainer process's ``--work-dir`` (``NodeRuntime``)."""
    return Path(work_dir) / "trainer"


def run_paths(work_dir: Path, run_id: str) -> list[Path]:
    """The files and folders a node (``work_dir``) keeps for ``run_id``, those that exist."""
    if not run_id or "/" in run_id or run_id.startswith("."):
        raise ValueError(f"invalid run id {run_id!r}")
    work_dir = Path(work_dir)
    paths = [run_folder(trainer_dir(work_dir), run_id), work_dir / "weights" / run_id,
             run_versions(trainer_dir(work_dir), run_id)]
    data = work_dir / "data"
    if data.is_dir():
        paths += sorted(p for p in data.iterdir()
                        if (m := DATA_FILE.fullmatch(p.name)) is not None and m.group("run") == run_id)
    return [p for p in paths if p.exists() or p.is_symlink()]


def runs_on_node(work_dir: Path) -> set[str]:
    """The run ids that have files on this node."""
    work_dir = Path(work_dir)
    runs: set[str] = set()
    for folder in (trainer_dir(work_dir), work_dir / "weights", versions_root(trainer_dir(work_dir))):
        if folder.is_dir():
            runs |= {p.name for p in folder.iterdir()
                     if p.is_dir() and not p.name.startswith(".") and not is_temp_dir(p)}
    data = work_dir / "data"
    if data.is_dir():
        runs |= {m.group("run") for p in data.iterdir() if (m := DATA_FILE.fullmatch(p.name)) is not None}
    return runs


def size_of(paths: list[Path]) -> int:
    """Bytes of the files at or under ``paths``, each inode once (the engines' folders are hard
    links to the trainer's exports): what ``du -sb`` counts for the files."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for path in paths:
        files = [path] if not path.is_dir() or path.is_symlink() else (
            Path(root) / name for root, _dirs, names in os.walk(path) for name in names)
        for f in files:
            try:
                st = f.lstat()
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def reclaim_run(work_dir: Path, run_id: str) -> int:
    """Remove ``run_id``'s files on this node (the caller knows the run has closed and that
    nothing on the node serves it any more); the bytes they held."""
    paths = run_paths(work_dir, run_id)
    total = size_of(paths)
    for path in paths:
        trash = path.with_name(f"{TRASH_PREFIX}{uuid.uuid4().hex[:8]}-{path.name}")
        try:
            path.rename(trash)
        except FileNotFoundError:
            continue
        _remove(trash)
    return total


def remove_trash(work_dir: Path) -> None:
    """Folders a reclaim renamed but did not finish removing (the agent was stopped)."""
    work_dir = Path(work_dir)
    for folder in (trainer_dir(work_dir), work_dir / "weights", work_dir / "data", versions_root(trainer_dir(work_dir))):
        if folder.is_dir():
            for p in folder.iterdir():
                if p.name.startswith(TRASH_PREFIX):
                    _remove(p)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
