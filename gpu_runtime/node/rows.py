"""A run's dataset splits on this node: downloaded once, kept in memory for the run's rollouts."""

from __future__ import annotations

import threading
from pathlib import Path

from gpu_runtime.data.datasets import load_jsonl
from gpu_runtime.store.uri import open_store


class DatasetRows:
    """``work_dir``: the node's (the files land in its ``data/``, ``gpu_runtime.node.reclaim``)."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self._rows: dict[str, list[dict]] = {}
        self._lock = threading.Lock()

    def rows(self, store_uri: str, key: str) -> list[dict]:
        """A dataset split's rows, cached with the other splits of the same run (train, eval)."""
        with self._lock:
            if key not in self._rows:
                path = self.work_dir / "data" / key.replace("/", "_")
                if not path.exists():
                    open_store(store_uri).get_file(key, path)
                folder = key.rpartition("/")[0]
                self._rows = {k: v for k, v in self._rows.items() if k.rpartition("/")[0] == folder}
                self._rows[key] = load_jsonl(path)
            return self._rows[key]
