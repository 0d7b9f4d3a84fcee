"""The trainer's side of ``engines.weight_sync: distributed``: rank 0 of the per-push
weight-update group, broadcasting the version it just published from memory.

The state sent is the published one (the export naming, merged under LoRA), so its
``weights_checksum`` is the version's checksum: each trainer hands it over as cheaply as
it holds it (``Trainer.broadcast_tensors``: views of the model's own tensors, a fsdp2 cell's
gathered weights, the folder DP cells exported for the version, which the page cache still
holds). Refused (before joining) when the trainer does not hold that version: the fleet
then pushes the folder from disk.
"""

from __future__ import annotations

import logging
import time

import torch

from gpu_runtime.proc import faults
from gpu_runtime.weight_sync.distributed import GroupSpec, Manifest, WeightGroup
from spec.trainer_rpc import BroadcastWeightsCall, WeightsBroadcast

log = logging.getLogger(__name__)


def broadcast(state: dict[str, torch.Tensor], call: BroadcastWeightsCall) -> WeightsBroadcast:
    """``state`` to the engines of ``call``'s group, as its rank 0."""
    spec = GroupSpec(call.master_address, call.master_port, call.world_size, call.group_name, call.backend)
    manifest = Manifest(call.names, call.dtypes, call.shapes, call.bucket_bytes)
    t0 = time.perf_counter()
    group = WeightGroup(spec, 0, call.timeout_s, store_hosted=call.store_hosted)
    try:
        joined = time.perf_counter()
        faults.delay("weight_broadcast")
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
