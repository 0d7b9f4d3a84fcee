"""A rollout node's side of a cross-host push: its engines join the trainer's group and receive.

The node registers the engines it brings (``group_rendezvous.Rendezvous.register``), and
with the roster in hand each engine joins at its rank (the node's first rank + its index x
its tensor-parallel size) and receives the version (``Receive``: SGLang's three requests,
``gpu_runtime.engine.weight_push.receive_broadcast``). The manifest comes with the roster,
from the trainer's node, so the node needs no copy of the version to know what to expect.

The result names the engines that got it; the strategy (``strategies.CrossHostReceive``)
has the others load it by the pull path. A node left out of the roster, a store it cannot
reach, a member that dies: all end within the group's timeouts, as a fallback.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from gpu_runtime.weight_sync.distributed import GroupError, GroupSpec, Manifest, manifest_from_request
from gpu_runtime.weight_sync.distributed_push import PushResult, Receive
from gpu_runtime.weight_sync.group_rendezvous import Rendezvous
from gpu_runtime.weight_sync.group_roster import Registration, Roster

log = logging.getLogger(__name__)


@dataclass
class GroupMember:
    """This node's seat in one cross-host push of ``version`` (``checksum``): where the group
    meets, the node's index in it, and how to get the version on disk for the engines the
    group does not reach (``materialize``: pulled into ``folder`` from the trainer's node)."""

    rendezvous: Rendezvous
    node: int
    version: str
    checksum: str
    folder: Path  # where the version's folder is on this node once materialized
    materialize: Callable[[], Path]
    machine: str = ""
    registered: bool = False  # set once this node registered (with engines or declining)

    def decline(self, why: str) -> None:
        """Register no engine (this node pulls), unless it registered already: the trainer's node
        then stops waiting for it. Best effort: a store it cannot reach is the trainer's to expire."""
        if not self.registered:
            self.registered = True
            self.rendezvous.decline(self.node, why, self.machine)


def member_push(
    urls: list[str], member: GroupMember, *, receive: Receive, devices: tuple[str, ...], send_checksum: bool = True,
    request_timeout_s: float = 600.0, ranks_per_engine: int = 1,
) -> PushResult:
    """Register ``urls`` (the healthy engines, in slot order) in ``member``'s group and have each
    receive the version at its rank. ``devices``: the engines' devices, one per url."""
    t0 = time.perf_counter()
    out = PushResult()
    reg = Registration(node=member.node, engines=len(urls), ranks_per_engine=ranks_per_engine, devices=devices,
                       machine=member.machine, why="" if urls else "no healthy engine")
    member.registered = True
    try:
        roster = member.rendezvous.register(reg)
    except GroupError as joined:
        return _all_failed(out, urls, str(joined), t0)
    offset = roster.seat(member.node)
    if offset is None or not urls:
        why = roster.why or f"node {member.node} is not in the group's roster"
        return _all_failed(out, urls, why, t0, trainer_error=roster.why)
    manifest = _manifest(roster)
    out.nbytes = manifest.nbytes
    rdv = member.rendezvous
    spec = GroupSpec(rdv.master_address, rdv.master_port, roster.world_size, rdv.group_name, roster.backend)
    receive_one = functools.partial(
        receive, spec=spec, manifest=manifest, version=member.version,
        checksum=member.checksum if send_checksum else None, request_timeout_s=request_timeout_s,
        group_timeout_s=rdv.timeout_s if send_checksum else None,
    )
    with ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="weight-receive") as pool:
        futures = [pool.submit(receive_one, u, offset + i * ranks_per_engine) for i, u in enumerate(urls)]
        for u, f in zip(urls, futures):
            err = f.exception()
            if err is None:
                out.updated.append(u)
            else:
                out.failed[u] = str(err)
    out.seconds = time.perf_counter() - t0
    log.info("cross-host push v%s (%s, %s, ranks %d..%d of %d): %d engines updated, %d failed in %.3fs",
             member.version, rdv.group_name, roster.backend, offset, offset + len(urls) * ranks_per_engine - 1,
             roster.world_size, len(out.updated), len(out.failed), out.seconds)
    return out


def _manifest(roster: Roster) -> Manifest:
    return manifest_from_request({**roster.manifest, "bucket_bytes": roster.bucket_bytes})


def _all_failed(out: PushResult, urls: list[str], why: str, t0: float, trainer_error: str = "") -> PushResult:
    out.failed = {u: why for u in urls}
    out.trainer_error = trainer_error or None
    out.seconds = time.perf_counter() - t0
    log.info("cross-host push: no broadcast for this node (%s)", why)
    return out
