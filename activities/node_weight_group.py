"""The trainer node's side of a cross-host weight push (``engines.weight_sync: distributed`` with
rollout nodes): ``open_weight_group`` hosts the push's rendezvous store on a port the OS picks
and tells the workflow where it is; ``broadcast_weights`` waits for the rollout nodes'
registrations, writes the roster, and has this node's trainer process send the version as
rank 0 (``gpu_runtime.weight_sync.group_rendezvous``, ``group_roster``).

``broadcast_weights`` reports an outcome, never an error the step would fail on: whatever goes
wrong here (the trainer holds another version, no node registered, a member died), the rollout
nodes it did not reach load the version by the pull path on their own, within the group's timeouts.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from temporalio import activity

from activities.heartbeat import with_heartbeat
from gpu_runtime.node.runtime import NodeRuntime
from gpu_runtime.weight_sync.distributed import DEFAULT_BUCKET_BYTES, GroupError, Manifest, folder_manifest
from gpu_runtime.weight_sync.group_rendezvous import HostedGroup, HostedGroups
from gpu_runtime.weight_sync.group_roster import declined, plan_roster
from spec.trainer_rpc import BroadcastWeightsCall
from workflows.contracts.weight_group import (
    BroadcastWeightsInput,
    BroadcastWeightsResult,
    OpenWeightGroupInput,
    WeightGroupAddress,
)
from workflows.failures import Failure, failure
from workflows.stubs import BROADCAST_WEIGHTS, OPEN_WEIGHT_GROUP

log = logging.getLogger(__name__)


def advertised_host(weights_url: str) -> str:
    """The address other nodes reach this one on: its weight server's (``--advertise-host``)."""
    return urlsplit(weights_url).hostname or ""


class WeightGroupActivities:
    """``version_folder(run_id, version, checksum)``: the folder of a version this node's trainer
    holds (``NodeActivities.version_folder``), whose safetensors header is what gets sent."""

    def __init__(self, runtime: NodeRuntime, version_folder: Callable[[str, int, str], Path]) -> None:
        self.rt = runtime
        self.version_folder = version_folder
        self.hosted = HostedGroups()

    @activity.defn(name=OPEN_WEIGHT_GROUP.name)
    def open_weight_group(self, inp: OpenWeightGroupInput) -> WeightGroupAddress:
        host = advertised_host(self.rt.weights_url)
        if not self.rt.trains or not host:
            raise failure(Failure.INVALID_INPUT, f"open_weight_group {inp.group.name}: node {self.rt.node_id} runs "
                          "no trainer (a --role rollout agent) or serves no weights: it cannot be rank 0")
        try:
            port = self.hosted.open(inp.group.name, inp.group.timeout_s)
        except GroupError as err:
            raise failure(Failure.TRAINER_ERROR, str(err)) from err
        log.info("weight group %s: store at %s:%d for %d rollout nodes (%d ranks planned)", inp.group.name, host, port,
                 inp.group.nodes, inp.group.world_size)
        return WeightGroupAddress(master_address=host, master_port=port)

    @activity.defn(name=BROADCAST_WEIGHTS.name)
    def broadcast_weights(self, inp: BroadcastWeightsInput) -> BroadcastWeightsResult:
        t0 = time.perf_counter()
        group = self.hosted.take(inp.group.name)
        if group is None:
            return BroadcastWeightsResult(policy_version=inp.policy_version, error=(
                f"group {inp.group.name} is not open on node {self.rt.node_id} (expired, or the agent restarted)"))
        try:
            out = with_heartbeat(lambda: self._broadcast(inp, group))
        finally:
            group.close()
        out.seconds = time.perf_counter() - t0
        log.info("weight group %s: v%d to nodes %s (%d ranks, %s): %s in %.2fs", inp.group.name, inp.policy_version,
                 out.nodes, out.world_size, out.backend or "-", out.error or f"{out.nbytes / 1e6:.1f} MB",
                 out.seconds)
        return out

    def _broadcast(self, inp: BroadcastWeightsInput, group: HostedGroup) -> BroadcastWeightsResult:
        out = BroadcastWeightsResult(policy_version=inp.policy_version)
        manifest = self._manifest(inp)
        if isinstance(manifest, str):  # why not: every rollout node pulls, without waiting any longer
            group.publish(declined(manifest))
            out.error = manifest
            return out
        regs = group.registrations(inp.group.nodes, inp.group.timeout_s)
        request = manifest.as_request()
        roster = plan_roster(regs.values(), trainer_device=self.rt.placement.trainer,
                             trainer_machine=socket.gethostname(), manifest=request,
                             bucket_bytes=DEFAULT_BUCKET_BYTES)
        group.publish(roster)
        out.world_size, out.backend, out.nodes = roster.world_size, roster.backend, sorted(roster.offsets)
        if roster.world_size < 2:
            out.error = roster.why
            return out
        if missing := [n for n in range(inp.group.nodes) if n not in regs]:
            log.warning("weight group %s: nodes %s did not register within %.0fs: they pull v%d", inp.group.name,
                        missing, inp.group.timeout_s, inp.policy_version)
        try:
            sent = self.rt.trainer.broadcast_weights(BroadcastWeightsCall(
                run_id=inp.run_id, policy_version=inp.policy_version, checksum=inp.checksum,
                master_address=inp.address.master_address, master_port=inp.address.master_port,
                world_size=roster.world_size, group_name=inp.group.name, backend=roster.backend,
                timeout_s=inp.group.timeout_s, bucket_bytes=roster.bucket_bytes, store_hosted=True, **request,
            ))
        except Exception as err:  # noqa: BLE001 - a member died, a timeout: the nodes not reached pull
            out.error = f"{type(err).__name__}: {err}"
            return out
        out.nbytes, out.join_seconds, out.broadcast_seconds = sent.nbytes, sent.join_seconds, sent.broadcast_seconds
        return out

    def _manifest(self, inp: BroadcastWeightsInput) -> Manifest | str:
        """What the trainer will send (the version's names, dtypes and shapes), or why it cannot."""
        try:
            held = self.rt.trainer.held_weights(inp.run_id)
            if (held.policy_version, held.checksum) != (inp.policy_version, inp.checksum):
                return (f"the trainer holds v{held.policy_version} ({(held.checksum or '')[:12]}), not "
                        f"v{inp.policy_version} ({inp.checksum[:12]})")
            return folder_manifest(self.version_folder(inp.run_id, inp.policy_version, inp.checksum))
        except Exception as err:  # noqa: BLE001 - a dead trainer, a run not placed here: the nodes pull
            return f"cannot prepare the broadcast of v{inp.policy_version}: {type(err).__name__}: {err}"
