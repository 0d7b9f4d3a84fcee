"""The engines of a run on this node made to serve a version (``update_weights``): the
run's ``EngineSpec`` checked here, the version's folder made local, then started, resized,
recovered and pushed to by ``NodeRuntime.ensure_engines``, and every engine's checksum
compared with the trainer's."""

from __future__ import annotations

import time
from collections.abc import Callable

from temporalio import activity

from activities.heartbeat import with_heartbeat
from gpu_runtime.engine.auth import check_exposure, engine_token, is_loopback
from gpu_runtime.engine.backends import SGLangEngineBackend, vllm_python
from gpu_runtime.engine.fleet_types import NoHealthyEngine, WeightMismatch
from gpu_runtime.engine.weight_probe import unverifiable_reason
from gpu_runtime.weight_sync.http_pull import WeightPullError
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
        if inp.source_url:  # a rollout node: the version from the trainer's node, over the network
            try:
                folder = with_heartbeat(lambda: self.rt.local_weights.pulled(
                    inp.source_url, inp.run_id, inp.policy_version, inp.checksum))
            except WeightPullError as err:  # retried: a trainer node that is gone is the run's to replace
                raise failure(Failure.WEIGHT_PULL_FAILED, f"v{inp.policy_version} from {inp.source_url}: {err}") from err
        else:
            folder = self.rt.local_weights.folder(inp.store_uri, inp.run_id, inp.policy_version, inp.checksum,
                                                  export=self.exporter(inp.run_id, inp.policy_version))
        if e.backend == "sglang" and (why := unverifiable_reason(folder)) is not None:
            raise failure(Failure.INVALID_INPUT, f"engines.backend 'sglang': {why}")
        try:
            restarted = with_heartbeat(lambda: self.rt.ensure_engines(e, folder, inp.policy_version, inp.run_id))
        except WeightMismatch as err:
            raise failure(Failure.WEIGHT_MISMATCH, f"weight checksum mismatch: {err}") from err
        except NoHealthyEngine as err:
            raise failure(Failure.NO_HEALTHY_ENGINE, str(err)) from err
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
        weights_bytes = (folder / "model.safetensors").stat().st_size
        metrics.WEIGHT_SYNC_BYTES.inc(weights_bytes * sum(1 for s in snapshot if s.state == SlotState.HEALTHY))
        return UpdateWeightsResult(
            policy_version=inp.policy_version,
            restarted_slots=restarted,
            engines=[s.model_copy(update={"node": self.rt.node_id}) for s in snapshot],
            seconds=time.perf_counter() - t0,
            node_events=self.rt.drain_events(),
        )
