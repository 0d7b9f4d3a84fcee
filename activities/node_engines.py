"""The engines of a run on this node made to serve a version (``update_weights``): the
run's ``EngineSpec`` checked here, the version's folder made local, then started, resized,
recovered and pushed to by ``NodeRuntime.ensure_engines``, and every engine's checksum
compared with the trainer's. A rollout node given a seat in the push's group
(``engines.weight_sync: distributed``) has its engines receive the version from the
trainer's instead, and pulls it only for the engines the group did not reach."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

from temporalio import activity

from activities.heartbeat import with_heartbeat
from gpu_runtime.engine.auth import check_exposure, engine_token, is_loopback
from gpu_runtime.engine.backends import SGLangEngineBackend, vllm_python
from gpu_runtime.engine.fleet_types import NoHealthyEngine, WeightMismatch
from gpu_runtime.engine.weight_probe import unverifiable_reason
from gpu_runtime.weight_sync.group_rendezvous import Rendezvous
from gpu_runtime.weight_sync.http_pull import WeightPullError
from gpu_runtime.weight_sync.member_push import GroupMember
from gpu_runtime.node.runtime import NodeRuntime
from gpu_runtime.proc import metrics
from spec.status import SlotState
from workflows.contracts.training import UpdateWeightsInput, UpdateWeightsResult
from workflows.failures import Failure, failure
from workflows.stubs import UPDATE_WEIGHTS


def _check_vllm(host: str, python: str | None) -> None:
    """engines.backend vllm: its interpreter exists on this node and its servers bind loopback (vLLM's
    API key does not guard its RL routes: /collective_rpc, /pause, /update_weight_version)."""
    if not is_loopback(host):
        raise failure(Failure.INVALID_INPUT, f"engines.host {host!r}: engines.backend vllm binds loopback only "
                      "(vLLM's API key does not guard its RL routes, /collective_rpc among them)")
    try:
        vllm_python(python)
    except ValueError as err:
        raise failure(Failure.INVALID_INPUT, str(err)) from err


class EngineActivities:
    """``exporter(run_id, version)``: this node's trainer exporting a version again
    (``TrainerActivities.exporter``), for a version the store holds no copy of."""

    def __init__(self, runtime: NodeRuntime, exporter: Callable[[str, int], Callable[[], None]]) -> None:
        self.rt = runtime
        self.exporter = exporter

    def _seat(self, inp: UpdateWeightsInput) -> tuple[GroupMember, Path, int] | None:
        """This node's seat in the push's group (``inp.group``), with the folder and version its
        engines start from (the newest this node holds); None when it takes the pull path instead:
        a retry (the group it was given is over), no version here to start engines from."""
        seat = inp.group
        assert seat is not None
        rdv = Rendezvous(seat.address.master_address, seat.address.master_port, seat.group.name, seat.group.timeout_s)
        if activity.info().attempt > 1:
            return None
        base = self.rt.local_weights.newest(inp.run_id)
        if base is None or inp.engines.backend != "torch" or not inp.source_url:
            why = ("no version of the run on this node to start engines from" if base is None
                   else f"engines.backend {inp.engines.backend}" if inp.engines.backend != "torch"
                   else "no weight server to pull from")
            rdv.decline(seat.node, why, socket.gethostname())
            return None
        folder = self.rt.local_weights.expect(inp.source_url, inp.run_id, inp.policy_version, inp.checksum)
        member = GroupMember(rdv, seat.node, str(inp.policy_version), inp.checksum, folder,
                             materialize=lambda: self.rt.local_weights.materialize(folder),
                             machine=socket.gethostname())
        return member, *base

    @activity.defn(name=UPDATE_WEIGHTS.name)
    def update_weights(self, inp: UpdateWeightsInput) -> UpdateWeightsResult:
        t0 = time.perf_counter()
        e = inp.engines
        if e.backend == "sglang" and not SGLangEngineBackend.available():
            raise failure(
                Failure.INVALID_INPUT,
                "engines.backend 'sglang': sglang is not installed on this node (pip install '.[gpu]' on a CUDA node)",
            )
        if e.backend == "vllm":
            _check_vllm(e.host, e.vllm_python)
        try:
            check_exposure(e.host, engine_token(), "engines")
        except ValueError as err:
            raise failure(Failure.INVALID_INPUT, f"engines.host: {err}") from err
        seat = with_heartbeat(lambda: self._seat(inp)) if inp.group is not None else None
        if seat is not None:  # a rollout node in the push's group: engines start from a version held here
            member, folder, version = seat
        elif inp.source_url:  # a rollout node: the version from the trainer's node, over the network
            try:
                folder = with_heartbeat(lambda: self.rt.local_weights.pulled(
                    inp.source_url, inp.run_id, inp.policy_version, inp.checksum))
            except WeightPullError as err:  # retried: a trainer node that is gone is the run's to replace
                raise failure(Failure.WEIGHT_PULL_FAILED, f"v{inp.policy_version} from {inp.source_url}: {err}") from err
            # no trainer here to broadcast: the pulled folder is loaded from disk
            member, version = None, inp.policy_version
            e = e.model_copy(update={"weight_sync": "store"}) if e.weight_sync == "distributed" else e
        else:
            member, version = None, inp.policy_version
            folder = self.rt.local_weights.folder(inp.store_uri, inp.run_id, inp.policy_version, inp.checksum,
                                                  export=self.exporter(inp.run_id, inp.policy_version))
        if e.backend == "sglang" and (why := unverifiable_reason(folder)) is not None:
            raise failure(Failure.INVALID_INPUT, f"engines.backend 'sglang': {why}")
        try:
            restarted = with_heartbeat(lambda: self.rt.ensure_engines(e, folder, version, inp.run_id, member))
        except WeightMismatch as err:
            raise failure(Failure.WEIGHT_MISMATCH, f"weight checksum mismatch: {err}") from err
        except NoHealthyEngine as err:
            raise failure(Failure.NO_HEALTHY_ENGINE, str(err)) from err
        except WeightPullError as err:  # the engines the group did not reach could not pull the version either
            raise failure(Failure.WEIGHT_PULL_FAILED, f"v{inp.policy_version} from {inp.source_url}: {err}") from err
        finally:
            if member is not None:  # a node that failed before it registered: the trainer waits for it no longer
                member.decline("the node's push failed before its engines registered")
        fleet = self.rt.engines.fleet
        assert fleet is not None
        # an engine without a hash of its own (SGLang) reports the checksum of the folder whose
        # sampled parameters it was verified to hold (WeightGate.probe_verified), else none
        checksums = {s.checksum for s in fleet.snapshot() if s.state == SlotState.HEALTHY}
        if checksums != {inp.checksum}:
            raise failure(
                Failure.WEIGHT_MISMATCH,
                f"engines report checksums {sorted(c or '' for c in checksums)}, trainer {inp.checksum}",
            )
        snapshot = fleet.snapshot()
        metrics.ENGINES_HEALTHY.set(sum(1 for s in snapshot if s.state == SlotState.HEALTHY))
        metrics.PHASE_SECONDS.labels("update_weights").observe(time.perf_counter() - t0)
        weights_bytes = (folder / "model.safetensors").stat().st_size  # (a seat's: the version it started from)
        metrics.WEIGHT_SYNC_BYTES.inc(weights_bytes * sum(1 for s in snapshot if s.state == SlotState.HEALTHY))
        return UpdateWeightsResult(
            policy_version=inp.policy_version,
            restarted_slots=restarted,
            engines=[s.model_copy(update={"node": self.rt.node_id}) for s in snapshot],
            seconds=time.perf_counter() - t0,
            node_events=self.rt.drain_events(),
        )
