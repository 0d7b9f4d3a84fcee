"""The fleet's side of ``engines.weight_sync: distributed``: one push = one group.

For a push of version v to the healthy engines, the fleet picks a free port, then runs
concurrently the trainer's ``broadcast_weights`` (rank 0, through a ``Broadcaster``)
and, per engine i, SGLang's ``/init_weights_update_group`` (rank 1 + i),
``/update_weights_from_distributed`` and ``/destroy_weights_update_group``. The
engines are told the manifest (names, dtypes, shapes) read from the version's folder
header, and, torch engines, the expected checksum: each one verifies what it received
before it loads it.

The result names the engines that got the version; the fleet pushes the folder from
disk to the others (``strategies.DistributedBroadcast``) and records a ``weight_sync_fallback``
event. A dead or late member fails the join or the broadcast within ``timeout_s``.
An engine's own side of the push (its three requests) is the fleet's ``receive``
(``gpu_runtime.engine.weight_push.receive_broadcast``): this layer speaks to no engine.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from gpu_runtime.proc.processes import free_port
from gpu_runtime.weight_sync.distributed import DEFAULT_TIMEOUT_S, GroupSpec, Manifest, folder_manifest

log = logging.getLogger(__name__)


class Receive(Protocol):
    """One engine's side of a push (``gpu_runtime.engine.weight_push.receive_broadcast``): join
    the group at ``rank``, receive the manifest's tensors, leave; raises when it did not get them."""

    def __call__(
        self, url: str, rank: int, *, spec: GroupSpec, manifest: Manifest, version: str, checksum: str | None,
        request_timeout_s: float, group_timeout_s: float | None,
    ) -> None: ...


@dataclass(frozen=True)
class Broadcaster:
    """How the fleet reaches the trainer (the node agent wires its trainer process in).

    ``held()``: the (version, checksum) the trainer holds in memory; ``send(spec,
    manifest, version, checksum)``: join as rank 0 and broadcast, raising on failure."""

    address: str  # the trainer's host: the group's master_address
    backend: str  # gloo (trainer on CPU) or nccl (trainer on CUDA)
    held: Callable[[], tuple[int | None, str | None]]
    send: Callable[[GroupSpec, Manifest, str, str], None]
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class PushResult:
    updated: list[str] = field(default_factory=list)  # engine urls that loaded the version
    failed: dict[str, str] = field(default_factory=dict)  # engine url -> why not
    trainer_error: str | None = None
    seconds: float = 0.0
    nbytes: int = 0


def push(
    urls: list[str], folder: str | Path, version: str, checksum: str | None, broadcaster: Broadcaster,
    *, receive: Receive, send_checksum: bool = True, request_timeout_s: float = 600.0, ranks_per_engine: int = 1,
    bucket_bytes: int = 0,
) -> PushResult:
    """Broadcast version ``version`` (the folder's weights, held by the trainer) to ``urls``.
    An engine of tensor-parallel size ``ranks_per_engine`` (SGLang ``--tp-size``) holds
    that many ranks from its ``rank_offset`` on, as in SGLang. ``send_checksum`` and
    ``bucket_bytes`` (torch engines): our extra fields, never sent to SGLang."""
    t0 = time.perf_counter()
    out = PushResult()
    manifest = _manifest_to_send(broadcaster, folder, version, checksum, bucket_bytes)
    if isinstance(manifest, str):  # why not: every engine loads the folder from disk instead
        out.trainer_error = manifest
        out.failed = {u: manifest for u in urls}
        return out
    assert checksum is not None  # _manifest_to_send refuses a push without one
    out.nbytes = manifest.nbytes
    spec = GroupSpec(broadcaster.address, free_port(), 1 + len(urls) * ranks_per_engine,
                     f"milestone-v{version}-{uuid.uuid4().hex[:8]}", broadcaster.backend)
    receive_one = functools.partial(
        receive, spec=spec, manifest=manifest, version=version, checksum=checksum if send_checksum else None,
        request_timeout_s=request_timeout_s, group_timeout_s=broadcaster.timeout_s if send_checksum else None,
    )
    with ThreadPoolExecutor(max_workers=1 + len(urls), thread_name_prefix="weight-push") as pool:
        trainer = pool.submit(broadcaster.send, spec, manifest, version, checksum)
        engines = [pool.submit(receive_one, u, 1 + i * ranks_per_engine) for i, u in enumerate(urls)]
        for u, f in zip(urls, engines):
            err = f.exception()
            if err is None:
                out.updated.append(u)
            else:
                out.failed[u] = str(err)
        err = trainer.exception()
        if err is not None:
            out.trainer_error = str(err)
    out.seconds = time.perf_counter() - t0
    log.info("distributed push v%s (%s, %s): %d engines updated, %d failed%s in %.3fs", version, spec.group_name,
             spec.backend, len(out.updated), len(out.failed),
             f" (trainer: {out.trainer_error})" if out.trainer_error else "", out.seconds)
    return out


def _manifest_to_send(
    broadcaster: Broadcaster, folder: str | Path, version: str, checksum: str | None, bucket_bytes: int,
) -> Manifest | str:
    """The folder's manifest when the trainer holds exactly this version, else why it cannot send it."""
    try:
        held = broadcaster.held()
        manifest = folder_manifest(folder).with_buckets(bucket_bytes)
    except Exception as err:  # noqa: BLE001 - a dead trainer, an unreadable folder: the disk push decides
        return f"cannot prepare the broadcast: {err}"
    if checksum is None or held != (int(version), checksum):
        return f"the trainer holds v{held[0]} ({(held[1] or '')[:12]}), not v{version} ({(checksum or '')[:12]})"
    return manifest

