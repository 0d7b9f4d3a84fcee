"""Weights handed to the engines of one node through shared memory, without disk.

The publisher writes one version as a single segment under ``/dev/shm`` (tmpfs: RAM,
never a disk): a JSON header — version, checksum, and per tensor its name, dtype, shape
and byte range — then the tensors' raw bytes, each 64-byte aligned. It is written
under a temporary name and renamed, so a reader sees a whole segment or none.

A reader maps the segment and copies the tensors straight into its model's
parameters (``torch.frombuffer`` over the mapping: no intermediate copy; a CUDA engine
copies host -> device from the same views). It refuses a segment whose version is not
the one it was asked to load, or whose bytes do not hash (``weights_checksum``, the
hash the store path uses) to the header's checksum, before touching its model; after
the load the engine re-hashes its own weights as after a load from disk, and the fleet
compares that with the trainer's checksum. The store stays the
durable copy; a segment lives as long as the node keeps it (``prune``).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gpu_runtime.models.causal_lm import load_exported_state_dict
from gpu_runtime.models.model_folder import weights_checksum

if TYPE_CHECKING:
    from transformers import PreTrainedModel
from gpu_runtime.models.safetensors_file import tensor_bytes
from gpu_runtime.proc.processes import pid_alive

MAGIC = b"MSWSHM01"
ALIGN = 64
# $MILESTONE_SHM_DIR: another tmpfs (a container's /dev/shm is often 64 MB: --shm-size)
DEFAULT_ROOT = Path(os.environ.get("MILESTONE_SHM_DIR") or ("/dev/shm" if Path("/dev/shm").is_dir() else "/tmp"))
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                                torch.int32, torch.int8, torch.uint8, torch.bool)}


class SegmentRefused(ValueError):
    """A segment that is not the version asked for, is malformed, or fails the checksum."""


@dataclass(frozen=True)
class Segment:
    path: Path
    version: str
    checksum: str
    nbytes: int


def segment_path(root: Path, tag: str, version: int | str) -> Path:
    """Where version ``version`` of ``tag`` (a run / node name: letters, digits, - and _) lives."""
    if not tag or any(not (c.isalnum() or c in "-_") for c in tag):
        raise ValueError(f"weight sync tag {tag!r}: letters, digits, - and _ only")
    return root / f"milestone-weights-{tag}-v{version}"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def publish(state_dict: dict[str, torch.Tensor], version: int | str, *, tag: str,
            root: Path = DEFAULT_ROOT, checksum: str | None = None) -> Segment:
    """Write ``state_dict`` (``export_state_dict`` naming, any device) as version ``version``."""
    checksum = checksum or weights_checksum(state_dict)
    entries: list[dict[str, Any]] = []
    offset = 0
    tensors = []
    for name in sorted(state_dict):
        t = state_dict[name].detach().contiguous().cpu()
        if str(t.dtype) not in _DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be shared")
        offset = _align(offset)
        nbytes = t.numel() * t.element_size()
        entries.append({"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
        tensors.append(t)
        offset += nbytes
    header = json.dumps({"version": str(version), "checksum": checksum, "tensors": entries}).encode()
    data_start = _align(len(MAGIC) + 8 + len(header))
    total = data_start + offset
    path = segment_path(root, tag, version)
    st = os.statvfs(root)
    if st.f_bavail * st.f_frsize < total:
        raise OSError(f"{root}: {st.f_bavail * st.f_frsize / 2**20:.0f} MiB free, a weight segment of version "
                      f"{version} needs {total / 2**20:.0f} MiB (a container: --shm-size; or set MILESTONE_SHM_DIR)")
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header)
        for e, t in zip(entries, tensors):
            f.seek(data_start + e["offset"])
            if e["nbytes"]:
                f.write(tensor_bytes(t))
        f.truncate(total)
    os.replace(tmp, path)
    return Segment(path, str(version), checksum, total)


def publish_folder(folder: str | Path, version: int | str, *, tag: str, root: Path = DEFAULT_ROOT) -> Segment:
    """A model folder's weights (read once) as a segment, for engines that would each
    otherwise read the folder: the checksum is the folder's recorded one when it has one."""
    from safetensors.torch import load_file

    from gpu_runtime.models.model_folder import WEIGHTS_FILE, read_meta

    folder = Path(folder)
    return publish(load_file(str(folder / WEIGHTS_FILE)), version, tag=tag, root=root,
                   checksum=read_meta(folder).get("checksum"))


def read(path: str | Path) -> tuple[dict, dict[str, torch.Tensor], mmap.mmap]:
    """(header, name -> tensor view over the mapping, the mapping). The views are valid
    while the mapping is open: copy them out, then close it."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (FileNotFoundError, ValueError) as err:
        raise SegmentRefused(f"{path}: no weight segment ({err})") from err
    if mm[: len(MAGIC)] != MAGIC:
        mm.close()
        raise SegmentRefused(f"{path}: not a weight segment (bad magic)")
    (hlen,) = struct.unpack("<Q", mm[len(MAGIC): len(MAGIC) + 8])
    header = json.loads(mm[len(MAGIC) + 8: len(MAGIC) + 8 + hlen])
    data_start = _align(len(MAGIC) + 8 + hlen)
    short = [e["name"] for e in header["tensors"] if data_start + e["offset"] + e["nbytes"] > len(mm)]
    if short:
        mm.close()
        raise SegmentRefused(f"{path}: truncated at {short[0]}")
    buf = memoryview(mm)  # read-only: torch warns about writes it will never do
    out: dict[str, torch.Tensor] = {}
    for e in header["tensors"]:
        start, n = data_start + e["offset"], e["nbytes"]
        dtype = _DTYPES[e["dtype"]]
        raw = torch.frombuffer(buf[start: start + n], dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        out[e["name"]] = raw.view(dtype).reshape(e["shape"])
    buf.release()
    return header, out, mm


def load_into(model: PreTrainedModel, path: str | Path, *, version: int | str | None = None,
              checksum: str | None = None) -> Segment:
    """Verify the segment (its version, and its bytes against its header's checksum),
    then copy it into ``model`` in place (any device). A refused segment leaves the model
    as it was. The caller re-hashes the loaded model as after a load from disk."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")  # the views are only read
        header, tensors, mm = read(path)
    try:
        if version is not None and header["version"] != str(version):
            raise SegmentRefused(f"{path}: holds version {header['version']}, asked for {version}")
        if checksum is not None and header["checksum"] != checksum:
            raise SegmentRefused(f"{path}: header checksum {header['checksum'][:12]} is not the expected {checksum[:12]}")
        got = weights_checksum(tensors)
        if got != header["checksum"]:
            raise SegmentRefused(f"{path}: its bytes hash to {got[:12]}, its header says {header['checksum'][:12]}")
        with torch.no_grad():
            load_exported_state_dict(model, tensors)
    finally:
        del tensors
        try:
            mm.close()
        except BufferError:  # a view still referenced (a traceback frame): the mapping goes with it
            pass
    return Segment(Path(path), header["version"], header["checksum"], os.path.getsize(path))


def prune(root: Path, tag: str, keep: set[str]) -> list[Path]:
    """Delete ``tag``'s segments whose version is not in ``keep``; returns the deleted paths."""
    prefix = segment_path(root, tag, "").name
    gone = []
    for p in root.glob(prefix + "*"):
        v = p.name[len(prefix):]
        if ".tmp" in v or v not in keep:
            p.unlink(missing_ok=True)
            gone.append(p)
    return gone


class NodeSegments:
    """The segments one fleet publishes: the newest version only (older ones are deleted
    when a new one is published, all of them on ``close``). The tag starts with the
    publishing process's pid, so a node agent that was killed before ``close`` leaves
    segments ``prune_orphans`` can recognise."""

    def __init__(self, tag: str, root: Path = DEFAULT_ROOT) -> None:
        self.tag, self.root = f"pid{os.getpid()}-{tag}", root

    def publish_folder(self, folder: str | Path, version: int | str) -> Segment:
        seg = publish_folder(folder, version, tag=self.tag, root=self.root)
        prune(self.root, self.tag, keep={seg.version})
        return seg

    def close(self) -> None:
        prune(self.root, self.tag, keep=set())


def prune_orphans(root: Path = DEFAULT_ROOT) -> list[Path]:
    """Delete the segments of ``NodeSegments`` whose publishing process is gone (RAM a killed
    node agent would otherwise hold until reboot); returns the deleted paths."""
    gone = []
    for p in root.glob("milestone-weights-pid*"):
        pid = p.name.removeprefix("milestone-weights-pid").split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        p.unlink(missing_ok=True)
        gone.append(p)
    return gone

