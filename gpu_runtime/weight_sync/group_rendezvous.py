"""Where a cross-host push's group meets: a ``TCPStore`` hosted by the trainer node's agent.

The trainer node's agent opens the store (``HostedGroups.open``, the ``open_weight_group``
activity) on a port the OS picks, and keeps it bound until the push's ``broadcast_weights``
activity closes it (or, when that never comes, until it expires): the port the workflow hands
the rollout nodes cannot be taken by anyone else meanwhile, which a port merely reserved and
released (or one derived from the group name) could. Everyone connects to it as a client,
the trainer process (rank 0) included, and the same store carries:

- the rendezvous (``group_roster``): each rollout node's ``Registration`` under
  ``reg/<node>``, then the ``Roster`` the trainer's node writes under ``roster``;
- the process group's own keys (``distributed.WeightGroup``, SGLang's prefixes), apart.

Every wait is bounded: a member gives up on the roster after ``2 * timeout_s`` (the trainer's
node waits ``timeout_s`` for registrations, after its own activity started), and falls back.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from gpu_runtime.weight_sync.distributed import GroupError
from gpu_runtime.weight_sync.group_roster import Registration, Roster

log = logging.getLogger(__name__)

EXPIRY_FACTOR = 4  # an open group nobody broadcasts on is closed after this many timeouts


def _rendezvous(store: dist.Store, group_name: str) -> dist.PrefixStore:
    """The rendezvous keys' store: apart from the process group's (``<name>`` and ``<name>/``)."""
    return dist.PrefixStore(f"{group_name}:rendezvous", store)


class HostedGroup:
    """One push's store, served by this process (the trainer node's agent)."""

    def __init__(self, group_name: str, timeout_s: float, host: str = "0.0.0.0") -> None:
        self.group_name, self.timeout_s = group_name, timeout_s
        self.expires = time.monotonic() + EXPIRY_FACTOR * timeout_s
        try:
            self._store: dist.TCPStore | None = dist.TCPStore(host, 0, None, True, timedelta(seconds=timeout_s),
                                                              wait_for_workers=False)
        except Exception as err:  # noqa: BLE001 - torch raises RuntimeError / DistNetworkError
            raise GroupError(f"cannot host the store of group {group_name} on {host}: {err}") from err
        self.port = self._store.port
        self._keys: dist.PrefixStore | None = _rendezvous(self._store, group_name)

    def registrations(self, nodes: int, wait_s: float) -> dict[int, Registration]:
        """The registrations of nodes ``0..nodes-1`` that arrive within ``wait_s`` (returns as soon
        as every one did: the store wakes this wait on the last one, no polling)."""
        keys = [f"reg/{n}" for n in range(nodes)]
        try:
            self.keys.wait(keys, timedelta(seconds=wait_s))
        except Exception as err:  # noqa: BLE001 - torch's timeout (DistStoreError): some never came
            log.info("group %s: not every node registered within %.0fs: %s", self.group_name, wait_s, err)
        return {n: Registration.from_json(self.keys.get(k)) for n, k in enumerate(keys) if self.keys.check([k])}

    def publish(self, roster: Roster) -> None:
        self.keys.set("roster", roster.to_json())

    def close(self) -> None:
        self._store = self._keys = None  # the server stops with its last reference

    @property
    def keys(self) -> dist.PrefixStore:
        if self._keys is None:
            raise GroupError(f"group {self.group_name}: its store is closed")
        return self._keys


class HostedGroups:
    """The groups this agent hosts, by name: opened by one activity, taken by the next."""

    def __init__(self) -> None:
        self._open: dict[str, HostedGroup] = {}
        self._lock = threading.Lock()

    def open(self, group_name: str, timeout_s: float) -> int:
        """Host ``group_name``'s store (again: a retried open returns the same port); its port."""
        with self._lock:
            self._expire()
            if group_name not in self._open:
                self._open[group_name] = HostedGroup(group_name, timeout_s)
            return self._open[group_name].port

    def take(self, group_name: str) -> HostedGroup | None:
        """The open group, now the caller's to close (None: never opened here, or expired)."""
        with self._lock:
            self._expire()
            return self._open.pop(group_name, None)

    def _expire(self) -> None:
        now = time.monotonic()
        for name in [n for n, g in self._open.items() if g.expires < now]:
            log.warning("weight group %s: opened but never broadcast on; closed", name)
            self._open.pop(name).close()


@dataclass(frozen=True)
class Rendezvous:
    """A member's way to the hosted store of one push."""

    master_address: str
    master_port: int
    group_name: str
    timeout_s: float

    def _connect(self) -> dist.PrefixStore:
        try:
            store = dist.TCPStore(self.master_address, self.master_port, None, False,
                                  timedelta(seconds=self.timeout_s), wait_for_workers=False)
        except Exception as err:  # noqa: BLE001
            raise GroupError(f"group {self.group_name}: cannot reach its store at {self.master_address}:"
                             f"{self.master_port} within {self.timeout_s:g}s: {err}") from err
        return _rendezvous(store, self.group_name)

    def decline(self, node: int, why: str, machine: str = "") -> None:
        """Register node ``node`` with no engine (it pulls the version): the trainer's node stops
        waiting for it. Best effort: a store it cannot reach is the trainer's node's to expire."""
        try:
            self.register(Registration(node=node, engines=0, machine=machine, why=why))
        except GroupError as err:
            log.info("group %s: could not decline for node %d: %s", self.group_name, node, err)

    def register(self, reg: Registration) -> Roster:
        """Register ``reg``, then wait (at most ``2 * timeout_s``) for the roster."""
        keys = self._connect()
        t0 = time.perf_counter()
        try:
            keys.set(f"reg/{reg.node}", reg.to_json())
            if reg.engines == 0:
                return Roster(world_size=0, why=reg.why)
            keys.wait(["roster"], timedelta(seconds=2 * self.timeout_s))
            roster = Roster.from_json(keys.get("roster"))
        except GroupError:
            raise
        except Exception as err:  # noqa: BLE001 - a timeout, a store that went away
            raise GroupError(f"group {self.group_name}: no roster for node {reg.node} after "
                             f"{time.perf_counter() - t0:.1f}s: {err}") from err
        log.info("group %s: node %d seated at rank %s of %d (%s) in %.2fs", self.group_name, reg.node,
                 roster.seat(reg.node), roster.world_size, roster.backend, time.perf_counter() - t0)
        return roster
