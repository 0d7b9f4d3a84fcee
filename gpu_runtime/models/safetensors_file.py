"""A ``.safetensors`` file written in place, over the pages of a file that already exists.

The trainer exports every policy version as a model folder; ``safetensors.save_file``
creates a new file each time, so every version's bytes land in freshly allocated page
cache. On the VM the project is measured on, that allocation is most of the export's cost
(1.45 GB at the 0.36B shape: 2.5 s through ``save_file``, 0.26 s written over the pages of
an existing file of the same size; ``docs/cost-per-step.md``). ``write_safetensors`` writes
the same bytes ``save_file`` does (same header, same tensor order: a test compares them) and,
given an existing file, writes over it and truncates it to its new length instead of
replacing it.

``Spares`` is where a node keeps model files it may write over: the weights file of a
version folder that was pruned, taken only when no other name links to it (an engine's
folder, a checkpoint upload): a file is never written while another folder can reach it.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
from pathlib import Path

import torch

# safetensors' dtype names, in its own order (it writes larger dtypes first, then by name)
_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int32: "I32", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64",
}
_RANK = {d: i for i, d in enumerate(_DTYPES)}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, uncopied (a CPU contiguous tensor, 0-dim included)."""
    return t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


def layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> tuple[bytes, list[str]]:
    """(the file's first bytes: length + JSON header padded to 8, the tensor names in file order)."""
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name here")
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name}: only contiguous CPU tensors are written in place")
    order = sorted(tensors, key=lambda n: (-_RANK[tensors[n].dtype], n))
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, order


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` to ``path`` as ``safetensors.torch.save_file`` would, over the
    existing file's pages when ``path`` exists (then truncated to the new length). Returns
    the file's length. Not atomic: write into a folder that is renamed when whole."""
    head, order = layout(tensors, metadata)
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.write(head)
        for name in order:
            f.write(tensor_bytes(tensors[name]))
        size = f.tell()
        f.truncate(size)
    return size


class Spares:
    """Weights files kept to be written over (``write_safetensors``) instead of deleted:
    at most ``keep`` of them (one is enough for an export per step), in one folder of the node."""

    def __init__(self, folder: Path, keep: int = 1) -> None:
        self.folder, self.keep = Path(folder), keep

    def salvage(self, file: Path) -> None:
        """Keep ``file`` (moved here) when nothing else links to it; else, or when ``keep``
        are held already, it is only unlinked from where it was. A hard link made to it
        before the move shows in its link count after the move, and none can be made after."""
        self.folder.mkdir(parents=True, exist_ok=True)
        dst = self.folder / uuid.uuid4().hex
        try:
            os.rename(file, dst)
        except OSError:  # pruned meanwhile, or another filesystem: the caller deletes it as before
            return
        if os.stat(dst).st_nlink > 1 or sum(1 for _ in self.folder.iterdir()) > self.keep:
            dst.unlink()

    def take(self, dst: Path) -> bool:
        """Move a spare to ``dst`` (then written over); False when there is none."""
        if not self.folder.is_dir():
            return False
        for spare in sorted(self.folder.iterdir()):
            try:
                os.rename(spare, dst)
                return True
            except OSError:  # taken by a concurrent writer (or another filesystem): a fresh file then
                continue
        return False
