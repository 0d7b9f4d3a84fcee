"""The trainer's side of ``engines.weight_sync: distributed``: rank 0 of the per-push
weight-update group, broadcasting the version it just published from memory.

The state sent is the published one (the export naming, merged under LoRA), so its
``weights_checksum`` is the version's checksum; a trainer whose weights live in other
processes (a fsdp2 cell, DP cells) sends the folder it exported for the version, which
the page cache still holds. Refused (before joining) when the trainer does not
hold that version: the fleet then pushes the folder from disk.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from gpu_runtime.models.causal_lm import exported_tensors
from gpu_runtime.trainer.api import BroadcastWeightsCall, WeightsBroadcast
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from gpu_runtime.weight_sync.distributed import GroupSpec, Manifest, WeightGroup

log = logging.getLogger(__name__)


def fault_injection_delay() -> None:
    """Tests set MILESTONE_FAULT_WEIGHT_BROADCAST_DELAY_S so a SIGKILL lands after every
    member joined the group and before the first tensor is sent."""
    delay = float(os.environ.get("MILESTONE_FAULT_WEIGHT_BROADCAST_DELAY_S", "0"))
    if delay > 0:
        log.info("fault injection: waiting %.1fs before the broadcast", delay)
        time.sleep(delay)


def published_tensors(trainer: object, folder: Path) -> dict[str, torch.Tensor]:
    """What the engines load for this version: the full-tuned model's own tensors as views
    (no second copy of the weights on the trainer's device), LoRA's merged weights, or the
    exported folder for a trainer that keeps its weights elsewhere (cells)."""
    if isinstance(trainer, PolicyTrainer) and not trainer.lora:
        return exported_tensors(trainer.model)
    state = getattr(trainer, "published_state", None)
    if callable(state):
        return state()
    from safetensors.torch import load_file

    from gpu_runtime.models.model_folder import WEIGHTS_FILE

    return load_file(str(folder / WEIGHTS_FILE))


def broadcast(state: dict[str, torch.Tensor], call: BroadcastWeightsCall) -> WeightsBroadcast:
    spec = GroupSpec(call.master_address, call.master_port, call.world_size, call.group_name, call.backend)
    manifest = Manifest(call.names, call.dtypes, call.shapes, call.bucket_bytes)
    t0 = time.perf_counter()
    group = WeightGroup(spec, 0, call.timeout_s)
    try:
        joined = time.perf_counter()
        fault_injection_delay()
        t1 = time.perf_counter()
        nbytes = group.send(state, manifest)
        if torch.cuda.is_available() and call.backend == "nccl":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
    finally:
        group.close()
    log.info("broadcast v%d to %d engines: %.1f MB in %.3fs (join %.3fs)", call.policy_version, call.world_size - 1,
             nbytes / 1e6, t2 - t1, joined - t0)
    return WeightsBroadcast(policy_version=call.policy_version, nbytes=nbytes, join_seconds=joined - t0,
                            broadcast_seconds=t2 - t1)
