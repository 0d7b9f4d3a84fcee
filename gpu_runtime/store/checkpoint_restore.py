"""Reading a prefix's checkpoints: which are durable (a manifest that exists, parses and is
accepted), and restoring one into a folder with every file verified.

A corrupt or incomplete checkpoint is reported in ``events`` (the ``CheckpointStore``'s list)
and the previous durable one is tried; the keys of a checkpoint's objects are
``CheckpointKeys``' (``prefix/step-000012/<relpath>``).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gpu_runtime.store.checkpoint_manifest import (
    _STEP_DIR,
    MANIFEST,
    CheckpointInfo,
    NoUsableCheckpointError,
    parse_manifest,
    step_name,
)
from gpu_runtime.store.object_store import ObjectStore, file_sha256
from spec.events import CheckpointCorrupt, RunEvent, utc_now

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointKeys:
    """Where a prefix's checkpoints keep their objects: ``prefix/<step folder>/<relpath>``."""

    prefix: str  # stripped of slashes; "" is the store's root

    def key(self, name: str, rel: str) -> str:
        return f"{self.prefix}/{name}/{rel}" if self.prefix else f"{name}/{rel}"

    def split(self, key: str) -> tuple[str, str] | None:
        """(step folder, relpath) of a checkpoint object's key; None for any other key."""
        rest = key[len(self.prefix) + 1 :] if self.prefix else key
        name, _, rel = rest.partition("/")
        return (name, rel) if _STEP_DIR.match(name) and rel else None

    @property
    def listing(self) -> str:
        """The prefix ``ObjectStore.list`` is given for every checkpoint object."""
        return self.prefix + "/" if self.prefix else ""


class CheckpointReader:
    def __init__(self, store: ObjectStore, keys: CheckpointKeys, events: list[RunEvent],
                 accept: Callable[[CheckpointInfo], bool] | None = None) -> None:
        self.store = store
        self.keys = keys
        self.events = events  # the CheckpointStore's: a corrupt checkpoint is reported there
        # a manifest it refuses is not durable state (fencing: written by a placement left behind)
        self.accept = accept

    def _manifest_names(self) -> list[str]:
        """Step folders with a manifest, oldest first."""
        names = []
        for key in self.store.list(self.keys.listing):
            parts = self.keys.split(key)
            if parts and parts[1] == MANIFEST:
                names.append(parts[0])
        return sorted(names, key=lambda n: int(n[5:]))

    def _load(self, name: str) -> CheckpointInfo | None:
        try:
            info = parse_manifest(name, self.store.get_bytes(self.keys.key(name, MANIFEST)))
        except KeyError:
            return None
        except ValueError as e:
            log.warning("ignoring unparsable manifest: %s", e)
            return None
        if self.accept is not None and not self.accept(info):
            log.warning("ignoring checkpoint %s: its writer was left behind by a newer placement (meta %s)",
                        name, info.meta)
            return None
        return info

    def list_durable(self) -> list[CheckpointInfo]:
        """Every checkpoint whose manifest exists and parses, oldest first."""
        return [i for n in self._manifest_names() if (i := self._load(n)) is not None]

    def latest_durable(self) -> CheckpointInfo | None:
        for name in reversed(self._manifest_names()):
            if (info := self._load(name)) is not None:
                return info
        return None

    def newest_before(self, step: int) -> CheckpointInfo | None:
        """The newest durable checkpoint older than ``step`` (an upload's base: its unchanged
        files are not uploaded again)."""
        for name in reversed(self._manifest_names()):
            if int(name[5:]) < step and (info := self._load(name)) is not None:
                return info
        return None

    def restore(self, into: str | Path, durable: list[CheckpointInfo], step: int | None = None) -> CheckpointInfo:
        """``CheckpointStore.restore`` over ``durable`` (its ``list_durable``)."""
        into = Path(into)
        prefix = self.keys.prefix
        candidates = [i for i in reversed(durable) if step is None or i.step <= step]
        if step is not None and (not candidates or candidates[0].step != step):
            raise NoUsableCheckpointError(f"{self.store.uri(prefix or '.')}: no durable checkpoint {step_name(step)}")
        if not candidates:
            raise NoUsableCheckpointError(f"{self.store.uri(prefix or '.')}: no durable checkpoint")
        tmp = into.parent / f".{into.name}.restoring"
        for info in candidates:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            if self._download_verified(info, tmp):
                shutil.rmtree(into, ignore_errors=True)
                tmp.rename(into)
                log.info("restored checkpoint %s into %s", info.name, into)
                return info
        shutil.rmtree(tmp, ignore_errors=True)
        tried = ", ".join(i.name for i in candidates)
        raise NoUsableCheckpointError(f"{self.store.uri(prefix or '.')}: no checkpoint verifies (tried {tried}); see events")

    def _download_verified(self, info: CheckpointInfo, dest: Path) -> bool:
        for rel, e in info.files.items():
            path = dest / rel
            try:
                self.store.get_file(self.keys.key(e.stored_in, rel), path)
                actual = file_sha256(path)
            except KeyError:
                actual = "missing"
            if actual != e.sha256:
                self.events.append(CheckpointCorrupt(at=utc_now(), step=info.step, file=rel, stored_in=e.stored_in,
                                                     expected=e.sha256, actual=actual))
                log.error("checkpoint %s corrupt: %s (in %s) sha256 expected %s, got %s; trying the previous one",
                          info.name, rel, e.stored_in, e.sha256, actual)
                return False
        return True


__all__ = ["CheckpointKeys", "CheckpointReader"]
