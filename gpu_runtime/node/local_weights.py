"""A version's model folder on this node's disk, for its engines to load (``LocalWeights.folder``).

A rollout node whose engines got a version from the trainer's weight-update group
(``engines.weight_sync: distributed``) holds it in their memory only: ``expect`` records how
to pull its folder, and ``materialize`` does so the first time something needs it on disk (an
engine the group did not reach, an engine restarted between pushes)."""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpu_runtime.models.model_folder import WEIGHTS_FILE, link_folder, prune_version_folders, read_meta, spares_for
from gpu_runtime.engine.auth import engine_token
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.uri import open_store
from gpu_runtime.trainer.work_dir import engine_weights_folder, run_versions, weights_folder
from gpu_runtime.weight_sync.http_pull import pull_version

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Pull:
    source_url: str
    run_id: str
    version: int
    checksum: str


class LocalWeights:
    """``trainer_dir``: the node's trainer process's work dir (its exports, and the engines' folders)."""

    def __init__(self, trainer_dir: Path) -> None:
        self.trainer_dir = trainer_dir
        self._pending: dict[Path, _Pull] = {}  # folders not on disk yet, and where to pull them from
        self._pending_lock = threading.Lock()
        self._materialize_lock = threading.Lock()

    def folder(
        self, store_uri: str, run_id: str, version: int, checksum: str | None = None,
        export: Callable[[], None] | None = None,
    ) -> Path:
        """The version's model folder on local disk: hard links to this node's trainer export
        when it is that version with ``checksum`` (same disk: no copy); else downloaded from the
        store when it holds the version (a checkpoint's, under ``weights/v<N>``); else ``export`` has this node's trainer
        export it again (restored from the last checkpoint and replayed when it moved on), then
        linked. Once per version."""
        folder = engine_weights_folder(self.trainer_dir, run_id, version)
        if not (folder / WEIGHTS_FILE).exists():
            tmp = folder.with_name(folder.name + ".download")
            shutil.rmtree(tmp, ignore_errors=True)
            if not self._link_export(run_id, version, checksum, tmp):
                self._fetch(store_uri, run_id, version, checksum, export, tmp)
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)
        # an engines' folder's file is the trainer's export (hard links): once the trainer pruned
        # it too, the trainer writes its next export over it
        prune_version_folders(folder.parent, version,
                              spares=spares_for(weights_folder(self.trainer_dir, run_id, version)))
        return folder

    def pulled(self, source_url: str, run_id: str, version: int, checksum: str) -> Path:
        """The version's model folder, pulled from the trainer node's weight server at ``source_url``
        (a rollout node: no trainer here, and between checkpoints the store holds no weights).
        Once per version: a folder already here with ``checksum`` is kept."""
        folder = engine_weights_folder(self.trainer_dir, run_id, version)
        try:
            held = read_meta(folder)
        except (OSError, ValueError):
            held = {}
        if not ((folder / WEIGHTS_FILE).exists() and held.get("checksum") == checksum):
            shutil.rmtree(folder, ignore_errors=True)
            folder.parent.mkdir(parents=True, exist_ok=True)
            # over the weights file of a version pruned here (faster than a fresh file on this kind of VM)
            stats = pull_version(source_url, run_id, version, checksum, folder, token=engine_token(),
                                 spares=spares_for(folder))
            log.info("weights v%d of run %s: pulled %d bytes from %s in %.3f s", version, run_id, stats.bytes,
                     source_url, stats.seconds)
        prune_version_folders(folder.parent, version, spares=spares_for(folder))
        return folder

    def expect(self, source_url: str, run_id: str, version: int, checksum: str) -> Path:
        """The folder ``version`` will have here, pulled from ``source_url`` when first ``materialize``d
        (the engines got the version some other way; a folder already here with ``checksum`` is kept)."""
        folder = engine_weights_folder(self.trainer_dir, run_id, version)
        with self._pending_lock:  # an older version of the run is served no more: never pulled
            for old in [f for f, p in self._pending.items() if p.run_id == run_id and p.version < version]:
                del self._pending[old]
            self._pending[folder] = _Pull(source_url, run_id, version, checksum)
        return folder

    def materialize(self, folder: Path) -> Path:
        """``folder`` on disk: pulled now when it was ``expect``ed and is not here yet (a
        ``WeightPullError`` when its source cannot give it). Any other folder is returned as it is."""
        folder = Path(folder)
        with self._materialize_lock:  # one pull at a time into a folder
            with self._pending_lock:
                pull = self._pending.get(folder)
            if pull is not None:
                self.pulled(pull.source_url, pull.run_id, pull.version, pull.checksum)
                with self._pending_lock:
                    self._pending.pop(folder, None)
        return folder

    def newest(self, run_id: str) -> tuple[Path, int] | None:
        """The newest complete version folder of ``run_id`` the engines were given here (its
        path and version), or None: what engines start from before a version reaches them
        from the trainer's group."""
        parent = run_versions(self.trainer_dir, run_id) / "engines"
        for folder in sorted(parent.glob("v[0-9]*"), reverse=True):
            try:
                meta = read_meta(folder)
            except (OSError, ValueError):
                continue
            if (folder / WEIGHTS_FILE).exists() and isinstance(meta.get("weight_version"), int):
                return folder, int(meta["weight_version"])
        return None

    def _fetch(self, store_uri: str, run_id: str, version: int, checksum: str | None,
               export: Callable[[], None] | None, dst: Path) -> None:
        store = open_store(store_uri)
        weights_key = art.weights_prefix(run_id, version)
        if store.exists(f"{weights_key}/{WEIGHTS_FILE}") or export is None:
            for key in store.list(weights_key + "/"):  # nested files (a LoRA adapter/ folder) keep their place
                store.get_file(key, dst / key.removeprefix(weights_key + "/"))
            if not (dst / WEIGHTS_FILE).exists():
                raise FileNotFoundError(f"weights v{version} of run {run_id}: no export on this node and none "
                                        f"in the store at {weights_key}")
            return
        log.info("weights v%d: not exported here and not in the store: the trainer exports it again", version)
        export()
        if not self._link_export(run_id, version, checksum, dst):
            raise RuntimeError(f"weights v{version} of run {run_id}: the trainer's export does not hold it "
                               f"(checksum {checksum})")

    def _link_export(self, run_id: str, version: int, checksum: str | None, dst: Path) -> bool:
        """Hard-link the trainer's export of ``version`` into ``dst`` if its meta names that
        version and ``checksum``. The trainer never rewrites a file in place (it writes a new
        folder and renames it), so a link is as good as a copy; the engines' checksum gate
        still checks what they load. False (nothing left in ``dst``) when it cannot."""
        src = weights_folder(self.trainer_dir, run_id, version)
        try:
            meta = read_meta(src)
            if checksum is None or meta.get("checksum") != checksum or meta.get("weight_version") != version:
                return False
            link_folder(src, dst)
            if (dst / WEIGHTS_FILE).exists():
                return True
        except (OSError, ValueError) as err:  # pruned or replaced meanwhile, another disk: download instead
            log.info("weights v%d: no link to the trainer export (%s): downloading", version, err)
        shutil.rmtree(dst, ignore_errors=True)
        return False
