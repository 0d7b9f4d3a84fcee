"""An engine's memory release between RL phases: SGLang's ``/release_memory_occupation``
and ``/resume_memory_occupation`` for the torch engine.

When the trainer and the engines share a GPU (``engines.release_memory``), the engines
give their memory back while the trainer trains, and take it again before they generate.
Two regions, SGLang's tags:

- ``weights``: every parameter and buffer is copied to a host buffer (pinned on CUDA)
  and the module then points at that host copy, so the device tensors are freed. The
  host buffers are kept across releases (allocated once: pinned allocations are slow).
  A host copy, not a reload from the version's folder on resume: the folder may be
  pruned or never exist (``weight_sync: shared_memory``), a copy back is bitwise by
  construction, and a weight update while released simply lands in the host copy (the
  loaders copy in place, on whatever device the parameters are) and reaches the device
  at resume. The resume re-hashes the weights and refuses to serve if the checksum is
  not the one before the release (or the update's).
- ``kv_cache``: this engine builds its KV cache per batch and drops it after, so there is
  nothing resident to drop but the CUDA allocator's cached blocks (``empty_cache``).

While any region is released, generation is refused with ``EngineReleased`` (HTTP 503,
a message saying so), ``/health`` and ``/health_generate`` answer 200 with
``"status": "released"`` (so the fleet's probes never declare a sleeping engine dead),
and the weight routes work as usual (on the host copy).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")


class EngineReleased(RuntimeError):
    """A request that needs the device arrived while the engine's memory is released."""


def parse_tags(body: dict[str, Any]) -> tuple[str, ...]:
    """SGLang's request shape: ``{"tags": ["weights", "kv_cache"]}``; absent or null: all."""
    tags = body.get("tags")
    if tags is None:
        return TAGS
    if not isinstance(tags, list) or not tags or any(t not in TAGS for t in tags):
        raise ValueError(f"tags must be null or a non-empty list of {list(TAGS)}, got {tags!r}")
    return tuple(t for t in TAGS if t in tags)


def _module_tensors(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, bool]]:
    """(owner, name, is_parameter) of every parameter and buffer, each tensor once (a tied
    ``lm_head`` shares the embedding's Parameter object: moving it once moves both)."""
    out: list[tuple[torch.nn.Module, str, bool]] = []
    seen: set[int] = set()
    for m in module.modules():
        for table, is_param in ((m._parameters, True), (m._buffers, False)):
            for name, t in table.items():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append((m, name, is_param))
    return out


@dataclass
class HostWeights:
    """The module's tensors' host copies, reused across releases."""

    buffers: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)

    def offload(self, module: torch.nn.Module) -> int:
        """Copy every tensor to its host buffer and point the module at it; the device
        tensors are then unreferenced. Returns the bytes moved."""
        moved = 0
        with torch.no_grad():
            for owner, name, is_param in _module_tensors(module):
                t = owner._parameters[name] if is_param else owner._buffers[name]
                assert t is not None
                key = (id(owner), name)
                host = self.buffers.get(key)
                if host is None or host.shape != t.shape or host.dtype != t.dtype:
                    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
                    self.buffers[key] = host
                host.copy_(t)
                moved += host.numel() * host.element_size()
                if is_param:
                    t.data = host
                else:
                    owner._buffers[name] = host
        return moved

    def restore(self, module: torch.nn.Module, device: str) -> None:
        """Point the module at fresh device copies of its host tensors (a real copy on the
        CPU too, so the served weights never alias the host buffers)."""
        with torch.no_grad():
            for owner, name, is_param in _module_tensors(module):
                t = owner._parameters[name] if is_param else owner._buffers[name]
                assert t is not None
                fresh = torch.empty(t.shape, dtype=t.dtype, device=device)
                fresh.copy_(t)
                if is_param:
                    t.data = fresh
                else:
                    owner._buffers[name] = fresh


@dataclass
class MemoryOccupation:
    """What of one engine is released now, and how long the last release and resume took."""

    device: str
    released: set[str] = field(default_factory=set)
    host: HostWeights = field(default_factory=HostWeights)
    last_release_s: float = 0.0
    last_resume_s: float = 0.0

    @property
    def is_released(self) -> bool:
        return bool(self.released)

    def refuse_if_released(self, what: str) -> None:
        if self.released:
            raise EngineReleased(
                f"{what} refused: the engine's memory is released ({', '.join(sorted(self.released))}) "
                "while the trainer trains; POST /resume_memory_occupation first (engines.release_memory)"
            )

    def release(self, model: torch.nn.Module, tags: tuple[str, ...]) -> dict[str, Any]:
        """Release ``tags`` (idempotent: a released region stays released)."""
        t0 = time.perf_counter()
        moved = 0
        if "weights" in tags and "weights" not in self.released:
            moved = self.host.offload(model)
        self.released.update(tags)
        _empty_cache(self.device)
        self.last_release_s = time.perf_counter() - t0
        log.info("released %s (%d weight bytes to host) in %.1f ms", sorted(tags), moved, self.last_release_s * 1e3)
        return {"success": True, "message": f"released {sorted(tags)}", "released": sorted(self.released),
                "weight_bytes": moved}

    def resume(self, model: torch.nn.Module, tags: tuple[str, ...]) -> None:
        """Take ``tags`` back (idempotent); the caller verifies the weights' checksum."""
        t0 = time.perf_counter()
        if "weights" in tags and "weights" in self.released:
            self.host.restore(model, self.device)
        self.released.difference_update(tags)
        self.last_resume_s = time.perf_counter() - t0

    def info(self) -> dict[str, Any]:
        return {"released": sorted(self.released), "last_release_ms": round(self.last_release_s * 1e3, 3),
                "last_resume_ms": round(self.last_resume_s * 1e3, 3)}


def _empty_cache(device: str) -> None:
    """The CUDA allocator's cached, unused blocks back to the driver (what another process
    on the GPU can then allocate)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()


def release_route(state: Any, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /release_memory_occupation`` on an ``EngineState``: waits for the running
    batch (the engine's one lock), then releases."""
    tags = parse_tags(body)
    with state.lock:
        return state.memory.release(state.model, tags)


def resume_route(state: Any, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /resume_memory_occupation``: the weights back on the device, re-hashed; a
    checksum other than the one the engine served (or was updated to while released) is
    an error (HTTP 500: the fleet replaces the engine) and the engine stays released."""
    from gpu_runtime.models.model_folder import model_checksum

    tags = parse_tags(body)
    with state.lock:
        was_released = "weights" in state.memory.released
        state.memory.resume(state.model, tags)
        if was_released and "weights" in tags:
            got = model_checksum(state.model)
            if got != state.checksum:
                state.memory.released.add("weights")
                raise RuntimeError(f"resumed weights hash to {got[:12]}, the engine served {state.checksum[:12]}")
        log.info("resumed %s in %.1f ms version=%s", list(tags), state.memory.last_resume_s * 1e3, state.weight_version)
        return {"success": True, "message": f"resumed {list(tags)}", "released": sorted(state.memory.released),
                "weight_version": state.weight_version, "checksum": state.checksum}
