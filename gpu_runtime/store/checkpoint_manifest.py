"""Checkpoint manifests: the commit marker's format, its parser, and the related types."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gpu_runtime.store.object_store import StoreError

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


class NoUsableCheckpointError(RuntimeError):
    """No durable checkpoint (or none that verifies) exists under the prefix."""


class CheckpointUploadError(StoreError):
    """A checkpoint upload gave up after its retry deadline."""


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    size: int
    stored_in: str


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    name: str
    meta: dict[str, Any]
    files: dict[str, FileEntry]
    created_at: float


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff base_s, 2*base_s, ... capped at max_s; give up after deadline_s."""

    base_s: float = 0.5
    max_s: float = 10.0
    deadline_s: float = 600.0


def parse_manifest(name: str, data: bytes) -> CheckpointInfo:
    """Parse and validate a manifest; ValueError names the problem."""
    try:
        doc = json.loads(data)
        if doc.get("format") != FORMAT:
            raise ValueError(f"format {doc.get('format')!r} != {FORMAT}")
        step = int(doc["step"])
        if step_name(step) != name:
            raise ValueError(f"step {step} does not match folder {name}")
        files: dict[str, FileEntry] = {}
        for rel, e in doc["files"].items():
            if not isinstance(e, dict) or not _STEP_DIR.match(str(e.get("stored_in", ""))):
                raise ValueError(f"files[{rel!r}]: bad entry {e!r}")
            files[rel] = FileEntry(str(e["sha256"]), int(e["size"]), str(e["stored_in"]))
        meta = doc.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError("meta is not an object")
        return CheckpointInfo(step, name, meta, files, float(doc.get("created_at", 0.0)))
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"{name}/{MANIFEST}: {type(e).__name__}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{name}/{MANIFEST}: {e}") from None
