"""A weight push to a fleet: the version delivered to every healthy engine by the run's
``engines.weight_sync`` strategy (``gpu_runtime.weight_sync.strategies``), then gated.

Whichever way the version came, every engine that loaded it must report it and the
expected checksum (the folder's meta, else the first engine's; engines without a hash of
their own are probe-verified): a ``checksum_ok`` or ``checksum_mismatch`` event each, and
``WeightMismatch`` naming the disagreeing slots. An engine that fails to load is declared
dead; the gated recovery before the next push restarts it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from gpu_runtime.engine.client import EngineClient, EngineError
from gpu_runtime.engine.fleet_types import NoHealthyEngine, Slot, WeightMismatch
from gpu_runtime.engine.supervisor import SlotSupervisor
from gpu_runtime.weight_sync.distributed import (
    DEFAULT_BUCKET_BYTES,
    GroupSpec,
    Manifest,
)
from gpu_runtime.weight_sync.distributed_push import Broadcaster, PushResult, Receive
from gpu_runtime.weight_sync.member_push import GroupMember
from gpu_runtime.weight_sync.shared_memory import NodeSegments
from gpu_runtime.weight_sync.strategies import (
    CrossHostReceive,
    DiskLoad,
    DistributedBroadcast,
    SharedMemoryLoad,
    WeightReceiver,
    WeightSync,
)
from spec.events import EngineChecksum, WeightsReceived, WeightSyncFallback, utc_now
from spec.status import SlotState

log = logging.getLogger(__name__)


class WeightPush:
    """The fleet's side of a push (the strategies' ``Engines``). ``tag`` names the fleet's
    shared memory segments."""

    def __init__(self, slots: SlotSupervisor, tag: str) -> None:
        self.slots = slots
        self.disk = DiskLoad()
        self.shared_memory = SharedMemoryLoad(NodeSegments(tag))  # engines.weight_sync shared_memory
        self.last_push: PushResult | None = None  # engines.weight_sync distributed: the last push's outcome

    def close(self) -> None:
        self.shared_memory.close()

    def strategy(self, sync: str, broadcaster: Broadcaster | None, member: GroupMember | None = None) -> WeightSync:
        """``engines.weight_sync``'s strategy: ``distributed`` needs the trainer's ``broadcaster``, or,
        on a rollout node, this node's seat in the trainer's group (``member``)."""
        if sync == "distributed" and member is not None:
            backend = self.slots.backend
            return CrossHostReceive(member, devices=tuple(getattr(backend, "devices", ())),
                                    send_checksum=backend.supports_checksum,
                                    request_timeout_s=self.slots.generate_timeout_s,
                                    ranks_per_engine=int(getattr(backend, "tp_size", 1)))
        if sync == "distributed":
            if broadcaster is None:
                raise ValueError("update_weights: sync distributed needs a broadcaster (the trainer's)")
            backend = self.slots.backend
            return DistributedBroadcast(broadcaster, send_checksum=backend.supports_checksum,
                                        request_timeout_s=self.slots.generate_timeout_s,
                                        ranks_per_engine=int(getattr(backend, "tp_size", 1)),
                                        bucket_bytes=DEFAULT_BUCKET_BYTES if backend.supports_checksum else 0)
        return self.shared_memory if sync == "shared_memory" else self.disk

    def update_weights(
        self, model_path: str | Path, version: int | str, sync: str = "store", broadcaster: Broadcaster | None = None,
        member: GroupMember | None = None,
    ) -> dict[int, str]:
        """Push weights to every healthy engine in parallel (``sync``: ``store``, ``shared_memory``
        or ``distributed``, the strategies), then verify that every engine reports the expected
        checksum. Returns {slot: checksum}; raises WeightMismatch naming the disagreeing slots.
        ``member`` (a rollout node's cross-host push): ``model_path`` is where the version's folder
        goes once pulled, which the engines the group reached never need; the checksum expected
        is the member's."""
        path, ver = str(model_path), str(version)
        targets = self.slots.healthy()
        if not targets:
            if member is not None:
                member.decline("no healthy engine")
            raise NoHealthyEngine(f"no healthy engine to update (slots: {[s.state for s in self.slots.slots]})")
        strategy = self.strategy(sync, broadcaster, member)
        try:
            strategy.deliver(self, [s.url for s in targets], path, ver)
        finally:
            if isinstance(strategy, DistributedBroadcast | CrossHostReceive) and strategy.result is not None:
                self.last_push = strategy.result
        if isinstance(strategy, CrossHostReceive) and strategy.result is not None and strategy.result.updated:
            res = strategy.result
            self.slots.emit(WeightsReceived(at=utc_now(), version=ver, slots=[self._slot(u).index for u in res.updated],
                                            group=member.rendezvous.group_name if member else "",
                                            nbytes=res.nbytes, seconds=round(res.seconds, 3)))
        self.slots.model_path, self.slots.weight_version = path, ver
        return self._verify([s for s in targets if s.state == SlotState.HEALTHY], path, ver,
                            member.checksum if member is not None else None)

    # ---- the strategies' Engines ----------------------------------------------------
    def load_each(self, urls: list[str], load: Callable[[WeightReceiver], object]) -> None:
        """Each slot at ``urls`` runs ``load`` on a client of its own, in parallel; a slot that
        fails is declared dead."""
        slots = [self._slot(u) for u in urls]

        def one(s: Slot) -> str | None:
            c = self.slots.backend.client(s.url, self.slots.generate_timeout_s)
            try:
                load(c)
                return None
            except EngineError as e:
                return str(e)
            finally:
                c.close()

        for s, err in zip(slots, self.slots.pool.map(one, slots)):
            if err is not None:
                self.slots.declare_dead(s, f"weight update failed: {err}", hung=False)

    def fell_back(self, url: str, version: str, error: str | None, trainer_error: str) -> None:
        self.slots.emit(WeightSyncFallback(at=utc_now(), slot=self._slot(url).index, version=version, error=error,
                                           trainer_error=trainer_error))

    @property
    def receive(self) -> Receive:
        return receive_broadcast

    def slot_index(self, url: str) -> int:
        return self._slot(url).index

    def _slot(self, url: str) -> Slot:
        return next(s for s in self.slots.slots if s.url == url)

    # ---- the gate --------------------------------------------------------------------
    def _verify(self, targets: list[Slot], path: str, ver: str, expected: str | None = None) -> dict[int, str]:
        """Every target's reported weights against version ``ver`` and the expected checksum
        (``expected``, else the folder's; a ``checksum_ok`` / ``checksum_mismatch`` event each):
        {slot: checksum}, or WeightMismatch."""
        sup, gate = self.slots, self.slots.gate
        reports = list(sup.pool.map(sup.read_weights, targets))
        if expected is None or not sup.backend.supports_checksum:
            expected = gate.expected_checksum(path)
        if expected is None and sup.backend.supports_checksum and reports:
            expected = reports[0][1]
        bad: list[int] = []
        out: dict[int, str] = {}
        for s, (got_ver, got_sum) in zip(targets, reports):
            good = got_ver == ver and (expected is None or got_sum == expected)
            probed = good and not sup.backend.supports_checksum
            wrong: list[str] = []  # the sampled parameters that differ
            if probed:  # no full hash: spot-check sampled parameters
                got_sum, wrong = gate.probe_verified(s, path)
                good = got_sum is not None
            with sup.lock:
                s.weight_version, s.checksum = got_ver, got_sum
            sup.emit(EngineChecksum(at=utc_now(), kind="checksum_ok" if good else "checksum_mismatch", slot=s.index,
                                    version=got_ver, checksum=got_sum, probed=probed, mismatched=wrong,
                                    expected=None if good else expected))
            if not good:
                bad.append(s.index)
            out[s.index] = got_sum or ""
        if bad:
            raise WeightMismatch(bad, f"expected version={ver} checksum={expected}")
        return out


def receive_broadcast(
    url: str, rank: int, *, spec: GroupSpec, manifest: Manifest, version: str, checksum: str | None,
    request_timeout_s: float, group_timeout_s: float | None,
) -> None:
    """One engine's side of the push: join the group at ``rank``, receive the manifest's tensors, leave.
    ``checksum`` and ``group_timeout_s`` are our extra fields (``None``: not sent, as to SGLang)."""
    c = EngineClient(url, timeout_s=request_timeout_s)
    try:
        c.init_weights_update_group(master_address=spec.master_address, master_port=spec.master_port,
                                    rank_offset=rank, world_size=spec.world_size, group_name=spec.group_name,
                                    backend=spec.backend, timeout_s=group_timeout_s)
        try:
            c.update_weights_from_distributed(**manifest.as_request(), group_name=spec.group_name,
                                              version=version, checksum=checksum)
        finally:
            try:
                c.destroy_weights_update_group(spec.group_name)
            except EngineError as err:
                log.debug("%s: leaving %s failed: %s", url, spec.group_name, err)
    finally:
        c.close()
