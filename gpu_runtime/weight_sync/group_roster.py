"""Who is in a cross-host weight-update group, and at which ranks (torch-free, pure).

A cross-host push (``engines.weight_sync: distributed`` with ``engines.nodes > 0``) forms one
torch.distributed group of the trainer (rank 0, on the trainer's node) and the engines of
every rollout node. A group of fixed size fails as a whole when one member is missing
(every join waits for it until the timeout), and which engines can join is only known on
each node at push time: an engine died and was restarted or not, a node was lost, a node
has no folder to start engines from. So the ranks are not fixed by the workflow: each
rollout node *registers* the engines it brings (``Registration``), the trainer's node waits
for the nodes it expects (at most the group's timeout), then writes the ``Roster``: the
members in slot order (node 0's engines first), their first ranks, the world size, the
backend and what will be broadcast. A node that is not in the roster (late, lost, bringing
no engine) loads the version by the pull path; the others are broadcast to. With every
node and engine present the ranks are the workflow's plan: node i's engines from
``1 + i * num_engines`` on.

The rendezvous itself (where registrations and the roster are written) is
``group_rendezvous``; this module is only the data and the rule.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

Backend = Literal["gloo", "nccl"]


@dataclass(frozen=True)
class Registration:
    """What one rollout node brings to a push's group."""

    node: int  # the node's index in the run's rollout nodes (slot order)
    engines: int  # engines that will join (0: the node declines and pulls the version instead)
    ranks_per_engine: int = 1  # an engine's tensor-parallel size: ranks it holds from its first on
    devices: tuple[str, ...] = ()  # its engines' devices ("cpu", "cuda:0"), for the backend
    machine: str = ""  # its host name: two members on one GPU of one machine cannot share an NCCL group
    why: str = ""  # engines == 0: why not

    def __post_init__(self) -> None:
        if self.node < 0 or self.engines < 0 or self.ranks_per_engine < 1:
            raise ValueError(f"registration of node {self.node}: engines {self.engines} >= 0 and "
                             f"ranks_per_engine {self.ranks_per_engine} >= 1 required (node >= 0)")

    @property
    def ranks(self) -> int:
        return self.engines * self.ranks_per_engine

    def to_json(self) -> str:
        return json.dumps({"node": self.node, "engines": self.engines, "ranks_per_engine": self.ranks_per_engine,
                           "devices": list(self.devices), "machine": self.machine, "why": self.why})

    @classmethod
    def from_json(cls, text: str | bytes) -> Registration:
        d = json.loads(text)
        return cls(node=int(d["node"]), engines=int(d["engines"]), ranks_per_engine=int(d.get("ranks_per_engine", 1)),
                   devices=tuple(str(x) for x in d.get("devices", ())), machine=str(d.get("machine", "")),
                   why=str(d.get("why", "")))


@dataclass(frozen=True)
class Roster:
    """The group as the trainer's node decided it. ``world_size`` 0: no broadcast this push
    (``why``), every node pulls. ``manifest``: SGLang's ``names``/``dtypes``/``shapes``
    (``distributed.Manifest``), what the trainer sends, so a member needs no folder to read it
    from; ``bucket_bytes``: the packing both sides must agree on."""

    world_size: int
    backend: Backend = "gloo"
    offsets: dict[int, int] = field(default_factory=dict)  # node -> its first rank
    ranks: dict[int, int] = field(default_factory=dict)  # node -> ranks it holds
    manifest: dict[str, Any] = field(default_factory=dict)
    bucket_bytes: int = 0
    why: str = ""

    def seat(self, node: int) -> int | None:
        """``node``'s first rank, or None when it is not in the group."""
        return self.offsets.get(node) if self.world_size >= 2 else None

    def left_out(self, nodes: Iterable[int]) -> list[int]:
        """Of ``nodes``, those not in the group: they load the version by the pull path."""
        return [n for n in nodes if self.seat(n) is None]

    def to_json(self) -> str:
        return json.dumps({"world_size": self.world_size, "backend": self.backend,
                           "offsets": {str(k): v for k, v in self.offsets.items()},
                           "ranks": {str(k): v for k, v in self.ranks.items()},
                           "manifest": self.manifest, "bucket_bytes": self.bucket_bytes, "why": self.why})

    @classmethod
    def from_json(cls, text: str | bytes) -> Roster:
        d = json.loads(text)
        backend = str(d.get("backend", "gloo"))
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"roster backend {backend!r}: gloo or nccl")
        return cls(world_size=int(d["world_size"]), backend=cast(Backend, backend),
                   offsets={int(k): int(v) for k, v in d.get("offsets", {}).items()},
                   ranks={int(k): int(v) for k, v in d.get("ranks", {}).items()},
                   manifest=dict(d.get("manifest", {})), bucket_bytes=int(d.get("bucket_bytes", 0)),
                   why=str(d.get("why", "")))


def declined(why: str) -> Roster:
    """No broadcast this push (the trainer does not hold the version, no node brought an engine)."""
    return Roster(world_size=0, why=why)


def plan_roster(
    registrations: Iterable[Registration], *, trainer_device: str, trainer_machine: str,
    manifest: dict[str, Any] | None = None, bucket_bytes: int = 0,
) -> Roster:
    """The group of the nodes that registered engines: rank 0 the trainer, then each node's
    ranks in node order (duplicates: the last registration of a node counts)."""
    latest = {r.node: r for r in registrations}
    members = [latest[n] for n in sorted(latest) if latest[n].engines > 0]
    if not members:
        whys = "; ".join(f"node {r.node}: {r.why}" for r in latest.values() if r.why)
        return declined("no rollout node brought an engine" + (f" ({whys})" if whys else ""))
    offsets: dict[int, int] = {}
    ranks: dict[int, int] = {}
    nxt = 1
    for r in members:
        offsets[r.node], ranks[r.node] = nxt, r.ranks
        nxt += r.ranks
    return Roster(world_size=nxt, backend=roster_backend(trainer_device, trainer_machine, members), offsets=offsets,
                  ranks=ranks, manifest=dict(manifest or {}), bucket_bytes=bucket_bytes)


def roster_backend(trainer_device: str, trainer_machine: str, members: Iterable[Registration]) -> Backend:
    """NCCL when the trainer and every member engine are on CUDA devices, no two of them on
    the same device of the same machine (NCCL refuses two ranks on one GPU); else gloo, which
    stages the tensors through host memory. A member that names no device counts as CPU."""
    if not trainer_device.startswith("cuda"):
        return "gloo"

    def norm(d: str) -> str:
        return "cuda:0" if d == "cuda" else d

    seen = {(trainer_machine, norm(trainer_device))}
    for r in members:
        if not r.devices:
            return "gloo"
        for d in r.devices:
            if not d.startswith("cuda") or (r.machine, norm(d)) in seen:
                return "gloo"
            seen.add((r.machine, norm(d)))
    return "nccl"
