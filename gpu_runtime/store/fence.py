"""Fencing: every store write a node makes for a run carries the run's placement
epoch, and a write from an older epoch is refused.

``runs/<run>/fence.json`` holds the run's current epoch, the node that holds it and
the history of placements (epoch, node, first step it (re)trains). ``claim_node``
reads the next epoch from it; the chosen node's ``init_policy`` raises the fence
to that epoch with a compare-and-swap (``ObjectStore.update``: a lock file on a
local store, a conditional put on S3), before anything else it writes. From then on
a ``FencedStore`` of an older epoch (a node the run left behind: partitioned,
stopped, or just slow) refuses every write with ``StaleEpoch``.

The check and the write are two store operations, so a write that passed its check
just before the fence moved can still land (at most the one object being written
at that moment). For checkpoints ``Fence.accepts`` keeps such a write out of the
durable state: a manifest whose epoch is older than a placement that took over at or
before its step is never restored. Other objects of a step are rewritten by the
epoch that redoes the step.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpu_runtime.store import artifacts as art
from gpu_runtime.store.object_store import ForwardingStore, ObjectStore

log = logging.getLogger(__name__)
FENCE_FILE = "fence.json"


def fence_key(run_id: str) -> str:
    return f"{art.run_prefix(run_id)}/{FENCE_FILE}"


@dataclass(frozen=True)
class Placement:
    epoch: int
    node: str
    from_step: int  # the first step this placement (re)trains: the steps before it were committed


@dataclass(frozen=True)
class Fence:
    epoch: int = 0
    node: str = ""
    history: tuple[Placement, ...] = field(default_factory=tuple)

    @classmethod
    def parse(cls, data: bytes | None) -> Fence:
        if not data:
            return cls()
        doc = json.loads(data)
        return cls(int(doc["epoch"]), str(doc.get("node", "")), tuple(Placement(**p) for p in doc.get("history", [])))

    def dump(self) -> bytes:
        doc = {"epoch": self.epoch, "node": self.node, "history": [p.__dict__ for p in self.history]}
        return json.dumps(doc, indent=1).encode()

    def accepts(self, step: int, epoch: int) -> bool:
        """May state of ``step`` written at ``epoch`` be durable? Not when a later
        placement took over at or before that step (the writer had been left behind)."""
        return not any(p.epoch > epoch and p.from_step <= step for p in self.history)


class ReadOnlyPrefix(RuntimeError):
    """A write outside the run's own prefix (a fork's ancestors are read-only)."""


class StaleEpoch(RuntimeError):
    """A write (or a claim) from a placement epoch the run has left behind."""

    def __init__(self, what: str, epoch: int, fence: Fence) -> None:
        super().__init__(
            f"refused {what}: written at placement epoch {epoch}, the run is at epoch {fence.epoch} "
            f"(node {fence.node or '?'})"
        )
        self.epoch = epoch
        self.fence = fence


def read_fence(store: ObjectStore, run_id: str) -> Fence:
    try:
        return Fence.parse(store.get_bytes(fence_key(run_id)))
    except KeyError:
        return Fence()


def next_epoch(store: ObjectStore, run_id: str) -> int:
    """The epoch a new placement of the run gets (read only: a claim writes nothing)."""
    return read_fence(store, run_id).epoch + 1


def raise_fence(store: ObjectStore, run_id: str, epoch: int, node: str, from_step: int) -> Fence:
    """Make ``epoch`` (held by ``node``) the run's fence, atomically. Idempotent for the
    same node and epoch (a retried ``init_policy``); ``StaleEpoch`` when the fence is
    already past it, or another node holds this epoch."""

    def update(old: bytes | None) -> bytes | None:
        cur = Fence.parse(old)
        if cur.epoch > epoch or (cur.epoch == epoch and cur.node != node):
            raise StaleEpoch(f"placement of node {node}", epoch, cur)
        if cur.epoch == epoch:
            return None  # already ours
        return Fence(epoch, node, (*cur.history, Placement(epoch, node, from_step))).dump()

    store.update(fence_key(run_id), update)
    return read_fence(store, run_id)


class FencedStore(ForwardingStore):
    """A run's store as one placement of it sees it: reads anything; writes only under
    the run's own prefix (a fork reads its ancestors' artifacts, never writes them),
    and, with ``epoch`` > 0, only while the run's fence is not past ``epoch``.
    ``epoch`` 0 (runs started before fencing, tools) skips the fence check."""

    def __init__(
        self, inner: ObjectStore, run_id: str, epoch: int, node: str = "",
        on_refused: Callable[[StaleEpoch], None] | None = None,
    ) -> None:
        super().__init__(inner)
        self.run_id = run_id
        self.prefix = art.run_prefix(run_id) + "/"
        self.epoch = epoch
        self.node = node
        self.on_refused = on_refused

    def _check(self, op: str, key: str) -> None:
        if not key.startswith(self.prefix) or key == fence_key(self.run_id):
            raise ReadOnlyPrefix(f"{op} {key}: run {self.run_id} writes only under {self.prefix} (its fence excepted)")
        if self.epoch <= 0:
            return
        fence = read_fence(self.inner, self.run_id)
        if fence.epoch > self.epoch:
            err = StaleEpoch(f"{op} {key}", self.epoch, fence)
            log.warning("stale write refused on node %s: %s", self.node or "?", err)
            if self.on_refused is not None:
                self.on_refused(err)
            raise err

    # writes: checked; reads are forwarded as they are (ForwardingStore)
    def put_bytes(self, key: str, data: bytes) -> None:
        self._check("put", key)
        self.inner.put_bytes(key, data)

    def put_file(self, key: str, path: str | Path) -> None:
        self._check("put", key)
        self.inner.put_file(key, path)

    def delete(self, key: str) -> None:
        self._check("delete", key)
        self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> None:
        self._check("delete", prefix)
        self.inner.delete_prefix(prefix)

    def update(self, key: str, fn: Callable[[bytes | None], bytes | None]) -> None:
        self._check("update", key)
        self.inner.update(key, fn)

