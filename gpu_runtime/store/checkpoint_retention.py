"""Checkpoint retention: after each commit, the newest ``keep_last`` durable checkpoints stay
with every file they reference; older checkpoints (manifest first) and the leftovers of
failed uploads go, in the store and in the local folder.

It runs on the upload thread after a commit (``CheckpointUploader``), so it never races an
upload of the same store (uploads run one at a time).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

from gpu_runtime.store.checkpoint_manifest import _STEP_DIR, MANIFEST, CheckpointInfo
from gpu_runtime.store.checkpoint_restore import CheckpointKeys
from gpu_runtime.store.object_store import ObjectStore

log = logging.getLogger(__name__)


def apply_retention(store: ObjectStore, keys: CheckpointKeys, local_dir: Path, keep_last: int,
                    durable: list[CheckpointInfo], busy: Callable[[], set[int]]) -> None:
    """Keep the newest ``keep_last`` of ``durable`` (oldest first) and every file they reference;
    delete older checkpoints (manifest first) and leftovers of failed uploads. ``busy``: the
    steps still uploading (asked once the store is pruned), whose local folders stay."""
    if not durable:
        return
    kept = durable[-keep_last:]
    kept_names = {i.name for i in kept}
    newest = durable[-1].step
    referenced = {(e.stored_in, rel) for i in kept for rel, e in i.files.items()}
    doomed: list[tuple[str, str]] = []
    for key in store.list(keys.listing):
        parts = keys.split(key)
        if parts is None or parts[0] in kept_names or int(parts[0][5:]) >= newest:
            continue
        if parts not in referenced:
            doomed.append(parts)
    # manifests first: a checkpoint disappears before any of its files do
    for name, rel in sorted(doomed, key=lambda x: x[1] != MANIFEST):
        store.delete(keys.key(name, rel))
    if doomed:
        log.info("retention: deleted %d objects; kept %s", len(doomed), sorted(kept_names))
    oldest_kept = kept[0].step
    uploading = busy()
    for d in local_dir.glob("step-*"):
        m = _STEP_DIR.match(d.name)
        if m and int(m.group(1)) < oldest_kept and int(m.group(1)) not in uploading and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


__all__ = ["apply_retention"]
