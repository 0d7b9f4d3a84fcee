"""The trainer process's state machine: policy version, restore, replay, train.

``TrainerService`` is what the RPC server dispatches to (``server.build_methods``): each
call binds the run it names (``RunBinding``: the run, its placement, its store and
checkpointer, its trainer), then brings the trainer to the version the call needs
(``VersionBuilder``: keep, or restore + replay, or SFT from scratch), trains, publishes the
version (``VersionPublisher``) or checkpoints it (``CheckpointSaver``). What trains the run
is ``TrainerLayouts``' choice and answers the ``Trainer`` protocol; the service never asks
which backend it holds.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from gpu_runtime.proc import faults
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.checkpoint_store import CheckpointStore
from gpu_runtime.store.fence import FencedStore
from gpu_runtime.trainer.layouts import TrainerLayouts
from gpu_runtime.trainer.protocol import Dead, Trainer
from gpu_runtime.trainer.run_binding import RunBinding
from gpu_runtime.trainer.version_builder import VersionBuilder, train
from gpu_runtime.trainer.version_publisher import VersionPublisher
from spec.events import RunEvent
from spec.status import CellInfo, DPCells
from spec.trainer_rpc import (
    BroadcastWeightsCall,
    CellsRestarted,
    CheckpointRequest,
    CheckpointSaved,
    HeldWeights,
    Rebuild,
    RunForgotten,
    RunSetup,
    StepBatch,
    TrainResult,
    VersionInfo,
    WeightsBroadcast,
)

log = logging.getLogger(__name__)


class Divergence(RuntimeError):
    """Training produced NaN/inf: not retryable; the run pauses on its last good state."""


class TrainerService:
    def __init__(self, work_dir: str | Path, cell_gpus: tuple[int, ...] = ()) -> None:
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.layouts = TrainerLayouts(self.work_dir, cell_gpus)  # what trains the run (single, fsdp2, DP, megatron)
        self.publisher = VersionPublisher(self.work_dir)
        self.run: RunBinding | None = None  # the run this process serves, once a call named it

    # ---- what the bound run holds (None before a call named a run) ------------------
    @property
    def setup(self) -> RunSetup | None:
        return self.run.setup if self.run is not None else None

    @property
    def trainer(self) -> Trainer | None:
        return self.run.trainer if self.run is not None else None

    @property
    def store(self) -> FencedStore | None:
        return self.run.store if self.run is not None else None

    @property
    def ckpts(self) -> CheckpointStore | None:
        return self.run.ckpts if self.run is not None else None

    def _bound(self) -> RunBinding:
        if self.run is None:
            raise RuntimeError("no run is bound: a call that names its run comes first")
        return self.run

    def _weights_dir(self, version: int) -> Path:
        """Where this node's trainer exports ``version`` of the bound run."""
        return self._bound().weights_dir(version)

    # ---- binding -------------------------------------------------------------------
    def _bind(self, setup: RunSetup) -> RunBinding:
        """The binding of ``setup``'s run, at this call's placement: kept for the same run,
        made afresh for another (whose cells end first)."""
        run = self.run
        if run is not None and run.trainer is not None and isinstance(run.trainer.health, Dead):
            # a fsdp2 cell that lost a rank / every DP cell lost: rebuilt by restore + replay
            self.layouts.discard_dead(run.trainer.health)
            run.trainer = None
        if run is not None and run.run_id == setup.run_id:
            run.rebind(setup)
            return run
        self.layouts.refuse_unservable(setup)
        self.run = None
        self.layouts.end_dp_group()  # another run's cells (a node rebinds between runs)
        self.run = RunBinding(setup, self.work_dir)
        return self.run

    def _ensure(self, run: RunBinding, target: int) -> tuple[Trainer, VersionInfo]:
        """``run``'s trainer brought to ``target`` (kept, or restored + replayed, or SFT from
        scratch) and published; what ``ensure_version`` answers."""
        t0 = time.perf_counter()
        rebuild: Rebuild | None = None
        sft_metrics: dict[str, float] = {}
        trainer = run.trainer
        if trainer is None or trainer.policy_version != target:
            trainer, rebuild, sft_metrics = VersionBuilder(run, self.layouts, self.publisher).build(target)
        info = self.publisher.publish(run, trainer)
        return trainer, info.model_copy(update={
            "rebuild": rebuild, "sft_metrics": sft_metrics, "seconds": time.perf_counter() - t0,
            "events": self.new_events(), "cell": self.cell_state(), "dp": self.dp_state(),
        })

    def _at_version(self, run: RunBinding, target: int) -> tuple[Trainer, VersionInfo | None]:
        """``run``'s trainer at ``target``: the one it holds, or rebuilt (then what
        ``ensure_version`` reports of the rebuild)."""
        if run.trainer is not None and run.trainer.policy_version == target:
            return run.trainer, None
        return self._ensure(run, target)

    # ---- the RPC methods -----------------------------------------------------------
    def ensure_version(self, setup: RunSetup, target: int) -> VersionInfo:
        """Bring the trainer to ``target``: keep, or restore + replay, or SFT from scratch."""
        return self._ensure(self._bind(setup), target)[1]

    def train_step(self, setup: RunSetup, batch: StepBatch) -> TrainResult:
        t0 = time.perf_counter()
        run = self._bind(setup)
        result_key = f"{art.step_prefix(setup.run_id, batch.step)}/train_result.json"
        if run.trainer is not None and run.trainer.policy_version == batch.policy_version + 1:
            if run.store.exists(result_key):  # a retry after success: never train twice
                return art.get_model(run.store, result_key, TrainResult)
        trainer, before = self._at_version(run, batch.policy_version)
        art.put_model(run.store, art.step_batch_key(setup.run_id, batch.step), batch)
        faults.delay("train")
        try:
            metrics = train(run, trainer, batch)
        except FloatingPointError as err:
            run.trainer = None  # possibly half-updated: the next call restores a checkpoint
            raise Divergence(f"step {batch.step}: {err}") from err
        except Exception as err:
            if self.layouts.step_failed(setup, trainer, err):  # rebuilt by restore + replay
                run.trainer = None
            raise
        trained = time.perf_counter()
        info = self.publisher.publish(run, trainer)
        log.info("step %d: trained in %.2fs, v%d exported in %.2fs", batch.step, trained - t0, info.policy_version,
                 time.perf_counter() - trained)
        run.saver.prepare(trainer)  # the next checkpoint's buffers, while the engines take this version
        if setup.offload_optimizer:
            trainer.release_optimizer()
        result = TrainResult(
            policy_version=info.policy_version,
            checksum=info.checksum,
            metrics=metrics,
            rebuild=before.rebuild if before else None,
            seconds=time.perf_counter() - t0,
            events=[*(before.events if before else []), *self.new_events()],
            cell=self.cell_state(),
            dp=self.dp_state(),
        )
        art.put_model(run.store, result_key, result)
        return result

    def checkpoint(self, setup: RunSetup, request: CheckpointRequest) -> CheckpointSaved:
        """Save version ``request.step`` (restoring it first if this process lost it)."""
        faults.enospc("checkpoint", request.step)
        _, before = self._at_version(self._bind(setup), request.step)
        faults.delay("checkpoint")
        saved = self.save_checkpoint(request.step, data_cursor=request.data_cursor, sync=request.sync)
        return saved.model_copy(update={
            "rebuild": before.rebuild if before else None,
            "events": [*(before.events if before else []), *self.new_events()],
        })

    def restart_cells(self, setup: RunSetup, indices: list[int]) -> CellsRestarted:
        """Start the given lost DP cells again (the workflow's heal, on its backoff schedule).
        Each heals from a peer in the next step's quorum. A cell that is not lost is left
        alone; with no live group there is nothing to heal (the next call builds all cells)."""
        run = self._bind(setup)
        outcome = self.layouts.restart_cells(setup, run.trainer, indices)
        return CellsRestarted(outcome=outcome, events=self.new_events(), dp=self.dp_state())

    def held_weights(self, run_id: str) -> HeldWeights:
        """The published version this trainer holds in memory for ``run_id``, if any."""
        return self.publisher.held(run_id, self.trainer)

    def broadcast_weights(self, call: BroadcastWeightsCall) -> WeightsBroadcast:
        """Rank 0 of the push's group (``engines.weight_sync`` distributed): broadcast the held
        version (refused, before joining, unless it is the one asked for)."""
        return self.publisher.broadcast(call, self.trainer)

    def forget_run(self, run_id: str, upload_wait_s: float = 300.0) -> RunForgotten:
        """A closed run: drop what this process holds for it (its files are reclaimed); a later call rebinds."""
        if self.run is None or self.run.run_id != run_id:
            return RunForgotten(run_id=run_id, held=False)
        uploaded = self.wait_for_uploads(upload_wait_s)
        self.layouts.end_dp_group()
        self.run = None
        self.publisher.forget()
        return RunForgotten(run_id=run_id, held=True, uploads_done=uploaded)

    # ---- checkpoints ---------------------------------------------------------------
    def save_checkpoint(self, step: int, *, data_cursor: int, sync: bool = False) -> CheckpointSaved:
        """Checkpoint version ``step`` (``CheckpointSaver.save``: the step waits for a snapshot)."""
        run = self.run
        if run is None or run.trainer is None:
            raise RuntimeError(f"checkpoint step {step} but the trainer holds no version")
        return run.saver.save(run.trainer, step, data_cursor=data_cursor, sync=sync,
                              checksum=self.publisher.checksum(run.run_id, step))

    def wait_for_uploads(self, timeout_s: float) -> bool:
        """Whether the bound run's checkpoints are all durable within ``timeout_s``."""
        return True if self.run is None else self.run.saver.wait(timeout_s)

    # ---- reports -------------------------------------------------------------------
    def dp_state(self) -> DPCells | None:
        return self.layouts.dp_state(self.setup)

    def cell_state(self) -> CellInfo | None:
        return self.layouts.cell_state(self.setup)

    def new_events(self) -> list[RunEvent]:
        """Events not yet reported: the cells' (fsdp2: started, failed; DP: lost, healed, ...)
        and the checkpoint store's (corrupt checkpoint, failed upload, refused write)."""
        if self.run is None:
            return []
        return self.run.new_events(self.layouts.take_events())

    def close(self) -> None:
        """End the processes behind the run's trainer (a fsdp2 cell's Ray, DP cells, the lighthouse)."""
        self.layouts.close()
