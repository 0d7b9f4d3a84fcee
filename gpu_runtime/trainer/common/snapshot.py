"""A trainer's state taken out of its live tensors now and written later.

A checkpoint's critical path is the copy (``StateSnapshot`` holds host copies of every
tensor file a trainer-state folder has); writing the files, hashing and uploading them
happen on the checkpoint store's upload thread while the run trains on. The copies go into
``SnapshotBuffers``, allocated once and reused by every later checkpoint of the same shapes:
a fresh 4 GB allocation costs its page faults on every checkpoint (measured ~2.5x the copy
itself on this machine), a reused one only the copy.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from gpu_runtime.trainer.common import state_io


class SnapshotBuffers:
    """Host tensors a snapshot copies into, one per (file, tensor name), reused while the shapes
    stay. One snapshot at a time: the caller waits for the previous snapshot's write before
    taking the next (``CheckpointStore.wait_for_uploads``)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, str], torch.Tensor] = {}
        self.lock = threading.Lock()  # held by the snapshot from copy to write

    def copy(self, file: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            src = t.detach()
            buf = self._bufs.get((file, name))
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = self._bufs[(file, name)] = torch.empty(src.shape, dtype=src.dtype, device="cpu")
            buf.copy_(src)
            out[name] = buf
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())


@dataclass
class StateSnapshot:
    """What ``save_state`` writes, held in memory: safetensors files by name, the meta fields
    (the Python RNG's state included, taken with the rest), and the files that do not change
    during a run (config, tokenizer) written by ``write_static``."""

    files: dict[str, dict[str, torch.Tensor]]
    meta: dict[str, Any]
    write_static: Callable[[Path], None]
    meta_name: str = state_io.META_FILE
    buffers: SnapshotBuffers | None = field(default=None, repr=False)

    def write(self, folder: Path) -> None:
        """The trainer-state folder (its meta file last): what ``save_state`` would have written
        when the snapshot was taken."""
        folder.mkdir(parents=True, exist_ok=True)
        for name, tensors in self.files.items():
            save_file(tensors, str(folder / name))
        self.write_static(folder)
        state_io.write_meta(folder, self.meta, self.meta_name)
