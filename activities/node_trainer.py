"""The trainer of a run on this node: its policy made ready, its train steps, DP cell
restarts and checkpoints, each a call into the node's trainer process (heartbeating,
shielded from cancellation, its failures mapped to retryable or final ones)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities import translate
from activities.disk import disk_full_failure
from activities.fence import RunFence
from activities.heartbeat import with_heartbeat
from gpu_runtime.node.runtime import NodeRuntime
from gpu_runtime.proc import metrics
from gpu_runtime.proc.rpc import RemoteError
from gpu_runtime.store.fence import StaleEpoch, raise_fence
from gpu_runtime.store.uri import open_store
from gpu_runtime.trainer.process import TrainerDied
from spec.events import RunEvent
from spec.status import CellState, DPCells
from spec.trainer_rpc import RunSetup
from workflows.contracts.cells import RestartCellsInput, RestartCellsResult
from workflows.contracts.placement import InitPolicyInput, PolicyInfo
from workflows.contracts.training import CheckpointInput, CheckpointResult, TrainStepInput, TrainStepResult
from workflows.failures import Failure, failure
from workflows.stubs import CHECKPOINT, INIT_POLICY, RESTART_CELLS, TRAIN_STEP

T = TypeVar("T")
# errors raised inside the trainer process that retrying cannot fix
FINAL_REMOTE = {"ValueError": Failure.INVALID_INPUT, "ValidationError": Failure.INVALID_INPUT,
                "Divergence": Failure.DIVERGENCE,
                "CellsDiverged": Failure.DIVERGENCE}  # DP cells that committed one step hold different state


def _trainer_error(err: Exception, what: str) -> ApplicationError:
    if isinstance(err, RemoteError) and err.error_type in FINAL_REMOTE:
        return failure(FINAL_REMOTE[err.error_type], f"{what}: {err.message}")
    if isinstance(err, TrainerDied):
        return failure(Failure.TRAINER_DIED, f"{what}: {err}")
    return failure(Failure.TRAINER_ERROR, f"{what}: {type(err).__name__}: {err}")


class TrainerActivities:
    def __init__(self, runtime: NodeRuntime, fence: RunFence) -> None:
        self.rt = runtime
        self.fence = fence

    @activity.defn(name=INIT_POLICY.name)
    def init_policy(self, inp: InitPolicyInput) -> PolicyInfo:
        run = inp.setup
        self.rt.set_run(run.run_id)
        if run.epoch:  # before anything this placement writes: older placements' writes are refused from here on
            try:
                raise_fence(open_store(run.store_uri), run.run_id, run.epoch, self.rt.node_id, inp.policy_version + 1)
            except StaleEpoch as err:
                raise self.fence.stale(run.run_id, run.epoch, str(err)) from err
        setup = self.rt.setups[run.run_id] = run.model_copy(update={"node_id": self.rt.node_id})
        info = self._trainer_call(run.run_id, run.epoch, INIT_POLICY.name,
                                  lambda: self.rt.trainer.ensure_version(setup, inp.policy_version))
        return translate.policy_info(info, self.rt.drain_events(), self.rt.node_id)

    @activity.defn(name=TRAIN_STEP.name)
    def train_step(self, inp: TrainStepInput) -> TrainStepResult:
        setup, batch = self._setup(inp.run_id, inp.epoch), inp.batch
        # engines.release_memory: the engines sleep while the trainer trains (update_weights wakes them)
        with_heartbeat(self.rt.engines.release)
        res = self._trainer_call(inp.run_id, inp.epoch, f"train_step {batch.step}",
                                 lambda: self.rt.trainer.train_step(setup, batch))
        bad = [k for k, v in res.metrics.items() if not math.isfinite(v)]
        if bad:
            raise failure(Failure.DIVERGENCE, f"step {batch.step}: non-finite {bad}")
        result = translate.train_step_result(res, self.rt.drain_events(), self.rt.node_id)
        metrics.record_train(result.metrics, result.seconds, len(result.replayed_steps))
        if inp.sampling is not None:  # dynamic sampling's counts
            metrics.record_sampling(inp.sampling.model_dump())
        metrics.POLICY_VERSION.set(result.policy_version)
        _record_dp(result.dp, result.node_events)
        return result

    @activity.defn(name=RESTART_CELLS.name)
    def restart_cells(self, inp: RestartCellsInput) -> RestartCellsResult:
        """Start the run's lost DP cells again (``trainer.cells``); each heals from a peer in the
        next step's quorum. A restart that fails is reported in ``outcome``, not raised."""
        setup = self._setup(inp.run_id, inp.epoch)
        res = self._trainer_call(inp.run_id, inp.epoch, f"restart DP cells {inp.cells}",
                                 lambda: self.rt.trainer.restart_cells(setup, inp.cells))
        result = translate.cells_restarted(res, self.rt.drain_events(), self.rt.node_id)
        _record_dp(result.dp, result.node_events)
        return result

    def exporter(self, run_id: str, version: int) -> Callable[[], None]:
        """This node's trainer exporting ``version`` of the run again (restore + replay when it
        holds another): for an engine push of a version the store holds no copy of."""
        def export() -> None:
            known = self.rt.setups.get(run_id)
            setup = self._setup(run_id, known.epoch if known else 0)  # NodeLost without one: re-placed
            self._trainer_call(run_id, setup.epoch, f"export v{version}",
                               lambda: self.rt.trainer.ensure_version(setup, version))
        return export

    @activity.defn(name=CHECKPOINT.name)
    def checkpoint(self, inp: CheckpointInput) -> CheckpointResult:
        t0 = time.perf_counter()
        setup = self._setup(inp.run_id, inp.epoch)
        saved = self._trainer_call(inp.run_id, inp.epoch, f"checkpoint {inp.step}",
                                   lambda: self.rt.trainer.checkpoint(setup, translate.checkpoint_request(inp)))
        seconds = time.perf_counter() - t0
        metrics.PHASE_SECONDS.labels("checkpoint").observe(seconds)
        return translate.checkpoint_result(saved, seconds, self.rt.drain_events())

    def _setup(self, run_id: str, epoch: int) -> RunSetup:
        setup = self.rt.setups.get(run_id)
        if setup is None:  # this process never ran init_policy for the run: re-place
            raise failure(Failure.NODE_LOST, f"node has no setup for run {run_id}")
        # the trainer writes at the calling step's epoch; its optimizer state waits on the host
        # between steps when the node's phases take turns on the GPU (engines.release_memory)
        return setup.model_copy(update={"epoch": epoch, "offload_optimizer": self.rt.engines.memory_phases.enabled})

    def _trainer_call(self, run_id: str, epoch: int, what: str, fn: Callable[[], T]) -> T:
        """A trainer call, heartbeating, its failures mapped. Shielded from the activity's
        cancellation: the trainer finishes a call whatever happens to the activity, so the
        agent waits to see how it ends, and a write the run's fence refused is reported
        even when the run has stopped waiting for this activity (it moved on)."""
        error: ApplicationError | None = None
        cause: Exception | None = None
        with activity.shield_thread_cancel_exception():  # a pending cancellation is raised on leaving
            try:
                return with_heartbeat(fn)
            except Exception as err:
                if isinstance(err, RemoteError) and err.error_type == "StaleEpoch":
                    error = self.fence.stale(run_id, epoch, f"{what}: {err.message}")
                else:
                    error = disk_full_failure(err, self.rt.node_id, run_id, what, self.fence.report) \
                        or _trainer_error(err, what)
                cause = err
        raise error from cause


def _record_dp(dp: DPCells | None, events: list[RunEvent]) -> None:
    if dp is not None:
        metrics.record_dp(sum(c.state == CellState.ALIVE for c in dp.cells), [e.kind for e in events])
