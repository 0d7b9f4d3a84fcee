"""Where the trainer process keeps a run's files under its ``--work-dir``."""

from __future__ import annotations

from pathlib import Path


def weights_folder(work_dir: Path, run_id: str, version: int) -> Path:
    """Where the trainer process (``--work-dir work_dir``) exports a version's model folder.
    The node agent links a version it pushes to its engines from there (same disk, no copy)."""
    return Path(work_dir) / run_id / "weights" / f"v{version:06d}"
