"""Whether a node releases memory between RL phases (``engines.release_memory``).

Colocated on one GPU, the trainer and the engines take turns: the engines free their
weights and KV cache while the trainer trains, and the trainer moves its optimizer state
to the host (and drops its grads) while the engines generate (Miles / slime: ``--colocate``
with ``--offload-rollout`` / ``--offload-train``). The config already turned ``auto`` into
``off`` for the rollout modes whose phases overlap (``spec.run``); what is left to
decide here is the node's placement, known only to its agent. Pure logic, torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_runtime.proc.devices import Placement


@dataclass(frozen=True)
class MemoryPhases:
    enabled: bool
    reason: str  # logged when the node resolves it, so a run's log says why


def resolve_release_memory(setting: str, placement: Placement) -> MemoryPhases:
    """``auto``: on when some engine shares the trainer's CUDA device; ``on``: always
    (on the CPU nothing is freed, but the phases run the same code: how it is tested);
    ``off``: never."""
    if setting == "off":
        return MemoryPhases(False, "engines.release_memory is off")
    if setting == "on":
        return MemoryPhases(True, "engines.release_memory is on")
    if setting != "auto":
        raise ValueError(f"engines.release_memory {setting!r}: auto, on or off")
    shared = [d for d in placement.engines if d == placement.trainer]
    if placement.trainer.startswith("cuda") and shared:
        return MemoryPhases(True, f"auto: engines colocated with the trainer on {placement.trainer}")
    if placement.trainer.startswith("cuda"):
        return MemoryPhases(False, f"auto: the engines ({', '.join(placement.engines)}) do not share the trainer's "
                                   f"{placement.trainer}")
    return MemoryPhases(False, "auto: the trainer is on the CPU (nothing on a device to release)")
