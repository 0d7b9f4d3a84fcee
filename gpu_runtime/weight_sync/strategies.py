"""How a new version reaches a fleet's engines (``engines.weight_sync``): one class per way.

- ``DiskLoad`` (``store``): each engine loads the version's folder from local disk;
- ``SharedMemoryLoad`` (``shared_memory``, torch engines): the folder is read once into a
  ``/dev/shm`` segment (``shared_memory``) the engines load from;
- ``DistributedBroadcast`` (``distributed``): the trainer broadcasts the version from memory
  over a torch.distributed group formed for this push (``distributed_push``); the engines it
  did not reach load the folder from disk (a ``weight_sync_fallback`` event each);
- ``CrossHostReceive`` (``distributed`` on a rollout node): the node's engines join the group
  of the trainer on another node (``member_push``); the ones it did not reach load the version
  by the pull path (pulled from the trainer's node, then from disk; a ``weight_sync_fallback``
  event each).

A strategy only delivers. The fleet (``gpu_runtime.engine.weight_push``) chose the engines,
declares dead the ones that fail to load, and checks every survivor's checksum afterwards,
whichever way the version came. It reaches its engines through ``Engines``, by url: this
layer lies below the engines and imports none of their code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from gpu_runtime.models.model_folder import read_meta
from gpu_runtime.weight_sync.distributed_push import Broadcaster, PushResult, Receive, push
from gpu_runtime.weight_sync.member_push import GroupMember, member_push
from gpu_runtime.weight_sync.shared_memory import NodeSegments


class WeightReceiver(Protocol):
    """An engine's weight-load requests (the engine clients of every backend have them)."""

    def update_weights_from_disk(self, path: str, version: int | str | None = None) -> dict[str, Any]: ...

    def update_weights_from_shared_memory(
        self, path: str, version: int | str, checksum: str | None = None,
    ) -> dict[str, Any]: ...


class Engines(Protocol):
    """The fleet's engines as a strategy reaches them."""

    def load_each(self, urls: list[str], load: Callable[[WeightReceiver], object]) -> None:
        """Each engine runs ``load`` on a client of its own, in parallel; one that fails is declared dead."""

    def fell_back(self, url: str, version: str, error: str | None, trainer_error: str) -> None:
        """The engine missed the fast path (``error``: its side, ``trainer_error``: the trainer's) and
        loads from disk instead (a ``weight_sync_fallback`` event)."""

    @property
    def receive(self) -> Receive:
        """One engine's side of a distributed push."""

    def slot_index(self, url: str) -> int:
        """The slot of the engine at ``url``."""


class WeightSync(Protocol):
    def deliver(self, engines: Engines, urls: list[str], folder: str, version: str) -> None:
        """The engines at ``urls`` load version ``version`` (the model folder ``folder``)."""


class DiskLoad:
    """``store``: every engine loads the folder, which the node downloaded or linked from its trainer's export."""

    def deliver(self, engines: Engines, urls: list[str], folder: str, version: str) -> None:
        engines.load_each(urls, lambda c: c.update_weights_from_disk(folder, version))


class SharedMemoryLoad:
    """``shared_memory``: the folder is read once into a segment the engines map and copy from.
    ``segments`` keeps the newest version's only; ``close`` deletes them (the fleet stops)."""

    def __init__(self, segments: NodeSegments) -> None:
        self.segments = segments

    def deliver(self, engines: Engines, urls: list[str], folder: str, version: str) -> None:
        seg = self.segments.publish_folder(folder, version)
        engines.load_each(urls, lambda c: c.update_weights_from_shared_memory(str(seg.path), version, seg.checksum))

    def close(self) -> None:
        self.segments.close()


class DistributedBroadcast:
    """``distributed``: the trainer (``broadcaster``) sends the version it holds to every engine
    at once (the folder's recorded checksum, which the trainer must hold); ``result`` is this
    push's outcome. ``send_checksum`` and ``bucket_bytes`` (torch engines): our extra fields,
    never sent to SGLang; ``ranks_per_engine``: an engine's tensor-parallel size."""

    def __init__(
        self, broadcaster: Broadcaster, *, send_checksum: bool, request_timeout_s: float,
        ranks_per_engine: int, bucket_bytes: int,
    ) -> None:
        self.broadcaster = broadcaster
        self.send_checksum = send_checksum
        self.request_timeout_s = request_timeout_s
        self.ranks_per_engine = ranks_per_engine
        self.bucket_bytes = bucket_bytes
        self.result: PushResult | None = None

    def deliver(self, engines: Engines, urls: list[str], folder: str, version: str) -> None:
        res = push(urls, folder, version, read_meta(folder).get("checksum"), self.broadcaster, receive=engines.receive,
                   send_checksum=self.send_checksum, request_timeout_s=self.request_timeout_s,
                   ranks_per_engine=self.ranks_per_engine, bucket_bytes=self.bucket_bytes)
        self.result = res
        from_disk = [u for u in urls if u not in res.updated]
        for u in from_disk:
            engines.fell_back(u, version, res.failed.get(u), res.trainer_error or "")
        DiskLoad().deliver(engines, from_disk, folder, version)


class CrossHostReceive:
    """``distributed`` on a rollout node: ``member``'s seat in the trainer's group. The engines
    the group does not reach load the version from its folder, pulled first (``member.materialize``).
    ``devices``: the engines' devices, by slot; the other arguments as ``DistributedBroadcast``'s."""

    def __init__(
        self, member: GroupMember, *, devices: tuple[str, ...], send_checksum: bool, request_timeout_s: float,
        ranks_per_engine: int,
    ) -> None:
        self.member = member
        self.devices = devices
        self.send_checksum = send_checksum
        self.request_timeout_s = request_timeout_s
        self.ranks_per_engine = ranks_per_engine
        self.result: PushResult | None = None

    def deliver(self, engines: Engines, urls: list[str], folder: str, version: str) -> None:
        res = member_push(urls, self.member, receive=engines.receive, devices=self._devices_of(engines, urls),
                          send_checksum=self.send_checksum, request_timeout_s=self.request_timeout_s,
                          ranks_per_engine=self.ranks_per_engine)
        self.result = res
        from_disk = [u for u in urls if u not in res.updated]
        if not from_disk:
            return
        for u in from_disk:
            engines.fell_back(u, version, res.failed.get(u), res.trainer_error or "")
        local = self.member.materialize()
        DiskLoad().deliver(engines, from_disk, str(local), version)

    def _devices_of(self, engines: Engines, urls: list[str]) -> tuple[str, ...]:
        slots = [engines.slot_index(u) for u in urls]
        return tuple(self.devices[i % len(self.devices)] for i in slots) if self.devices else ()
