"""Weights broadcast from the trainer to the engines over a torch.distributed group.

``engines.weight_sync: distributed`` (gloo when the trainer is on CPU, NCCL on CUDA).
The protocol is SGLang's distributed weight-update API, so the same trainer-side code
drives our torch engines and SGLang engines:

1. every member joins one group: the trainer as rank 0 (it hosts the rendezvous
   store), engine i as rank ``rank_offset`` = 1 + i (``POST /init_weights_update_group``
   on the engines, the ``broadcast_weights`` RPC on the trainer);
2. the trainer broadcasts each tensor of its published state, in the order of the
   manifest (names sorted, as ``weights_checksum`` hashes them; dtypes and shapes read
   from the version's safetensors header), and each engine receives them
   (``POST /update_weights_from_distributed`` with ``names``/``dtypes``/``shapes``);
3. everyone leaves the group (``POST /destroy_weights_update_group``).

The group is formed per push and destroyed after it, never kept: engines die and are
restarted between pushes, and a persistent group with a dead member blocks every
later collective until its timeout, so it would have to be rebuilt anyway. A join or
a collective waits at most ``timeout_s`` (not gloo's 30 minutes) for a peer.

An engine receives into fresh buffers and only loads them, under its generation lock,
once every tensor has arrived and their ``weights_checksum`` equals the expected one:
a broken broadcast (a dead peer, a timeout) leaves it on its old, consistent weights.

The keys the members write to the rendezvous store are those of SGLang's
``init_custom_process_group`` (a ``TCPStore`` at ``master_address:master_port``, then
``PrefixStore(group_name)`` and ``PrefixStore(group_name + "/")`` around the backend),
built with public torch classes only.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0  # a join or one broadcast waits this long for a peer (engines.weight_sync_timeout_s)
BACKENDS = ("gloo", "nccl")
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
                       "I64": "int64", "I32": "int32", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


class GroupError(RuntimeError):
    """Joining, broadcasting or receiving failed (a dead or late peer, a timeout, a bad manifest)."""


@dataclass(frozen=True)
class Manifest:
    """What is broadcast, in broadcast order: SGLang's ``names``, ``dtypes``, ``shapes``.

    ``bucket_bytes`` > 0 (ours, torch engines only; SGLang receives tensor by tensor):
    consecutive tensors are packed into one byte buffer of up to that size per broadcast
    (``buckets``), because each collective costs a round trip and a model has many
    small tensors (norms, biases)."""

    names: list[str]
    dtypes: list[str]  # torch dtype names without the ``torch.`` prefix ("float32")
    shapes: list[list[int]]
    bucket_bytes: int = 0

    def with_buckets(self, bucket_bytes: int) -> Manifest:
        return Manifest(self.names, self.dtypes, self.shapes, bucket_bytes)

    def sizes(self) -> list[int]:
        return [_numel(s) * torch.empty(0, dtype=parse_dtype(d)).element_size() for d, s in zip(self.dtypes, self.shapes)]

    def buckets(self) -> list[list[int]]:
        """Tensor indices per broadcast: one each without buckets; else consecutive tensors
        up to ``bucket_bytes`` (with their ``BUCKET_ALIGN`` padding; a larger one alone)."""
        if self.bucket_bytes <= 0:
            return [[i] for i in range(len(self.names))]
        out: list[list[int]] = []
        cur: list[int] = []
        used = 0
        for i, n in enumerate(self.sizes()):
            padded = _aligned(n)
            if cur and used + padded > self.bucket_bytes:
                out.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += padded
        if cur:
            out.append(cur)
        return out

    @property
    def nbytes(self) -> int:
        return sum(self.sizes())

    def as_request(self) -> dict[str, Any]:
        out: dict[str, Any] = {"names": self.names, "dtypes": self.dtypes, "shapes": self.shapes}
        if self.bucket_bytes > 0:
            out["bucket_bytes"] = self.bucket_bytes
        return out


BUCKET_ALIGN = 64  # each tensor starts at a multiple of this in a bucket (so it can be viewed as its dtype)
DEFAULT_BUCKET_BYTES = 4 * 2**20  # what the fleet asks torch engines for: packs the small tensors, larger ones go alone (no copy); bench_weight_sync


def _aligned(n: int) -> int:
    return (n + BUCKET_ALIGN - 1) // BUCKET_ALIGN * BUCKET_ALIGN


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def group_backend(trainer_device: str, engine_devices: list[str] | tuple[str, ...]) -> str:
    """gloo when the trainer trains on the CPU; NCCL when it is on a GPU no engine uses
    (disaggregated). Colocated (an engine on the trainer's GPU) or a CPU engine: gloo,
    which stages the tensors through host memory (NCCL refuses two ranks on one GPU)."""

    def norm(d: str) -> str:
        return "cuda:0" if d == "cuda" else d

    if not trainer_device.startswith("cuda"):
        return "gloo"
    engines = [norm(d) for d in engine_devices]
    if not engines or any(not d.startswith("cuda") for d in engines) or norm(trainer_device) in engines:
        return "gloo"
    return "nccl"


def parse_dtype(name: str) -> torch.dtype:
    """``float32`` or ``torch.float32`` -> ``torch.float32`` (SGLang sends either)."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def manifest_of(state: dict[str, torch.Tensor]) -> Manifest:
    names = sorted(state)
    return Manifest(names, [str(state[n].dtype).removeprefix("torch.") for n in names],
                    [list(state[n].shape) for n in names])


def folder_manifest(folder: str | Path) -> Manifest:
    """The manifest of a model folder's ``model.safetensors``, from its header only (no
    tensor bytes read): the fleet tells the engines what to expect before the broadcast."""
    from gpu_runtime.models.model_folder import WEIGHTS_FILE

    path = Path(folder) / WEIGHTS_FILE
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    names = sorted(header)
    try:
        dtypes = [_SAFETENSORS_DTYPES[header[k]["dtype"]] for k in names]
    except KeyError as err:
        raise ValueError(f"{path}: dtype {err} cannot be broadcast") from err
    return Manifest(names, dtypes, [list(header[k]["shape"]) for k in names])


def manifest_from_request(body: dict[str, Any]) -> Manifest:
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not isinstance(names, list) or not isinstance(dtypes, list) or not isinstance(shapes, list):
        raise ValueError("names, dtypes and shapes are required lists")
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) differ in length")
    for d in dtypes:
        parse_dtype(d)
    bucket_bytes = int(body.get("bucket_bytes") or 0)
    if bucket_bytes < 0:
        raise ValueError(f"bucket_bytes {bucket_bytes}: >= 0 (0: one broadcast per tensor)")
    return Manifest([str(n) for n in names], [str(d).removeprefix("torch.") for d in dtypes],
                    [[int(x) for x in s] for s in shapes], bucket_bytes)


@dataclass(frozen=True)
class GroupSpec:
    """SGLang's ``/init_weights_update_group`` fields (``rank_offset`` is the member's rank)."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str
    backend: str = "gloo"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: one of {', '.join(BACKENDS)}")
        if self.world_size < 2:
            raise ValueError(f"world_size {self.world_size}: a trainer and at least one engine")
        if not self.group_name:
            raise ValueError("group_name is required")


class WeightGroup:
    """This process's membership in one weight-update group. ``store_hosted``: the rendezvous
    store is served by someone else (a cross-host push: the trainer node's agent), so rank 0
    connects to it like every other member instead of serving it."""

    def __init__(self, spec: GroupSpec, rank: int, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                 store_hosted: bool = False) -> None:
        if not 0 <= rank < spec.world_size:
            raise ValueError(f"rank {rank} outside a group of {spec.world_size}")
        self.spec, self.rank, self.timeout_s = spec, rank, timeout_s
        timeout = timedelta(seconds=timeout_s)
        t0 = time.perf_counter()
        try:
            self._store: dist.TCPStore | None = dist.TCPStore(
                spec.master_address, spec.master_port, spec.world_size, rank == 0 and not store_hosted,
                timeout=timeout, wait_for_workers=False)
            prefixed = dist.PrefixStore(spec.group_name + "/", dist.PrefixStore(spec.group_name, self._store))
            if spec.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                self._pg: Any = dist.ProcessGroupNCCL(prefixed, rank, spec.world_size, opts)
            else:
                gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs lack it
                gloo._timeout = timeout
                gloo._devices = [gloo_device(spec.master_address)]
                self._pg = dist.ProcessGroupGloo(prefixed, rank, spec.world_size, gloo)
        except Exception as err:  # noqa: BLE001 - torch raises RuntimeError/DistStoreError/DistNetworkError
            raise GroupError(f"join {spec.group_name} as rank {rank}/{spec.world_size} at "
                             f"{spec.master_address}:{spec.master_port} ({spec.backend}) failed after "
                             f"{time.perf_counter() - t0:.1f}s (timeout {timeout_s:g}s): {err}") from err
        log.info("joined weight update group %s as rank %d/%d (%s) in %.2fs", spec.group_name, rank,
                 spec.world_size, spec.backend, time.perf_counter() - t0)

    def _broadcast(self, t: torch.Tensor, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = timedelta(seconds=self.timeout_s)
        try:
            self._pg.broadcast([t], opts).wait()
        except Exception as err:  # noqa: BLE001
            raise GroupError(f"group {self.spec.group_name} rank {self.rank}: broadcast of {what} failed: {err}") from err

    def send(self, state: dict[str, torch.Tensor], manifest: Manifest) -> int:
        """Rank 0: broadcast ``state`` in the manifest's order (and buckets); returns the bytes sent."""
        got = manifest_of(state)
        if (got.names, got.dtypes, got.shapes) != (manifest.names, manifest.dtypes, manifest.shapes):
            diff = sorted(set(got.names) ^ set(manifest.names)) or [
                n for n, a, b, c, d in zip(got.names, got.dtypes, manifest.dtypes, got.shapes, manifest.shapes)
                if (a, c) != (b, d)]
            raise GroupError(f"the trainer's state does not match the manifest (first differences: {diff[:3]})")
        sent = 0
        for bucket in manifest.buckets():
            names = [manifest.names[i] for i in bucket]
            tensors = [self._sendable(state[n]) for n in names]
            if len(tensors) == 1:
                buf = tensors[0]
            else:  # one byte buffer, each tensor at an aligned offset
                buf = torch.zeros(sum(_aligned(t.numel() * t.element_size()) for t in tensors), dtype=torch.uint8,
                                  device=tensors[0].device)
                off = 0
                for t in tensors:
                    n = t.numel() * t.element_size()
                    buf[off: off + n] = t.reshape(-1).view(torch.uint8)
                    off += _aligned(n)
            self._broadcast(buf, names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)} tensors)")
            sent += sum(t.numel() * t.element_size() for t in tensors)
        return sent

    def _sendable(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().contiguous()
        return t.cpu() if self.spec.backend == "gloo" and t.device.type != "cpu" else t

    def receive(self, manifest: Manifest, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Rank > 0: the manifest's tensors, received into fresh buffers (on ``device``
        with NCCL, on the CPU with gloo)."""
        where = torch.device(device) if self.spec.backend == "nccl" else torch.device("cpu")
        sizes = manifest.sizes()
        out: dict[str, torch.Tensor] = {}
        for bucket in manifest.buckets():
            names = [manifest.names[i] for i in bucket]
            if len(bucket) == 1:
                i = bucket[0]
                t = torch.empty(manifest.shapes[i], dtype=parse_dtype(manifest.dtypes[i]), device=where)
                self._broadcast(t, names[0])
                out[names[0]] = t
                continue
            buf = torch.empty(sum(_aligned(sizes[i]) for i in bucket), dtype=torch.uint8, device=where)
            self._broadcast(buf, f"{names[0]} .. {names[-1]} ({len(names)} tensors)")
            off = 0
            for i in bucket:
                out[manifest.names[i]] = buf[off: off + sizes[i]].view(parse_dtype(manifest.dtypes[i])).reshape(
                    manifest.shapes[i])
                off += _aligned(sizes[i])
        return out

    def close(self) -> None:
        pg, self._pg = getattr(self, "_pg", None), None
        shutdown = getattr(pg, "shutdown", None) or getattr(pg, "_shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - tearing down a broken group
                log.debug("shutdown of %s failed", self.spec.group_name, exc_info=True)
        self._store = None


def local_address_towards(host: str) -> str | None:
    """This machine's address on the route to ``host`` (no packet is sent), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return None


def gloo_device(master_address: str) -> Any:
    """The interface gloo binds for a group that meets at ``master_address``: the one on the
    route to it. Gloo's default resolves this machine's host name, which on many hosts names a
    loopback address (127.0.1.1) that members on other hosts cannot reach."""
    address = local_address_towards(master_address)
    if address is None:
        return dist.ProcessGroupGloo.create_default_device()
    return dist.ProcessGroupGloo.create_device(hostname=address)


class EngineGroups:
    """An engine's side of SGLang's three routes: the groups it is a member of, by name."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._groups: dict[str, WeightGroup] = {}
        self._lock = threading.Lock()

    def init(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /init_weights_update_group``: blocks until every member joined (or the timeout)."""
        try:
            spec = GroupSpec(str(body["master_address"]), int(body["master_port"]), int(body["world_size"]),
                             str(body.get("group_name") or "weight_update_group"), str(body.get("backend") or "nccl"))
            rank = int(body["rank_offset"])
        except KeyError as err:
            raise ValueError(f"{err.args[0]} is required") from err
        timeout_s = float(body.get("timeout_s") or self.timeout_s)  # ours: SGLang has no such field
        self.destroy({"group_name": spec.group_name})  # a leftover of a failed push under the same name
        group = WeightGroup(spec, rank, timeout_s)
        with self._lock:
            self._groups[spec.group_name] = group
        return {"success": True, "message": f"joined {spec.group_name} as rank {rank}"}

    def receive(self, body: dict[str, Any], device: str) -> dict[str, torch.Tensor]:
        """The tensors of ``POST /update_weights_from_distributed``. A failed receive
        leaves the group (it is broken: later collectives would only time out)."""
        name = str(body.get("group_name") or "weight_update_group")
        manifest = manifest_from_request(body)
        with self._lock:
            group = self._groups.get(name)
        if group is None:
            raise ValueError(f"no weight update group {name!r}: POST /init_weights_update_group first")
        log.info("receiving %d tensors (%.1f MB) from group %s", len(manifest.names), manifest.nbytes / 1e6, name)
        try:
            return group.receive(manifest, device)
        except GroupError:
            self.destroy({"group_name": name})
            raise

    def destroy(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /destroy_weights_update_group`` (a group it is not in: success too, idempotent)."""
        name = str(body.get("group_name") or "weight_update_group")
        with self._lock:
            group = self._groups.pop(name, None)
        if group is not None:
            group.close()
        return {"success": True, "message": f"left {name}" if group else f"not in {name}"}
