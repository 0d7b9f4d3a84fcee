"""The trainer process's state machine: policy version, restore, replay, train.

Trainer state at version v = last durable checkpoint c + replay of the stored
artifacts of steps c+1..v (DESIGN §6). Policy version v is produced by step v
(version 0 is the SFT warm-up), so checkpoint ``step-v`` holds version v.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gpu_runtime.proc import faults
from gpu_runtime.store import artifacts as art, lineage
from gpu_runtime.store.checkpoint_manifest import CheckpointInfo
from gpu_runtime.store.checkpoint_store import CheckpointStore
from gpu_runtime.data.datasets import load_jsonl, prompts_for_step
from gpu_runtime.models.model_folder import prune_version_folders, read_meta
from gpu_runtime.store.object_store import LocalStore
from gpu_runtime.store.fence import FencedStore, StaleEpoch, read_fence
from gpu_runtime.store.uri import open_store
from gpu_runtime.trainer.work_dir import weights_folder
from gpu_runtime.trainer import weight_broadcast
from gpu_runtime.trainer.checkpoint_saver import CheckpointSaver
from gpu_runtime.trainer.base_model import DONE, base_model_folder
from gpu_runtime.trainer.common.offload import OptimizerOffload
from gpu_runtime.trainer.common.step_samples import step_samples
from gpu_runtime.trainer.fsdp2.errors import CellFailed
from gpu_runtime.trainer.layouts import TrainerLayouts, layout
from gpu_runtime.trainer.megatron.trainer import runtime_problem
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from gpu_runtime.trainer.protocol import Dead, Trainer
from spec.status import CellInfo, DPCells, RunEvent
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
ADAPTER_DIR = "adapter"  # an adapter export's folder inside each published version


class Divergence(RuntimeError):
    """Training produced NaN/inf: not retryable; the run pauses on its last good state."""


class TrainerService:
    def __init__(self, work_dir: str | Path, cell_gpus: tuple[int, ...] = ()) -> None:
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.setup: RunSetup | None = None
        self.trainer: Trainer | None = None
        self.store: FencedStore | None = None
        self.ckpts: CheckpointStore | None = None
        self.saver: CheckpointSaver | None = None  # the run's checkpoints: snapshot now, write and upload after
        self.ancestors: list[tuple[int, CheckpointStore]] = []  # a fork: (last step, the ancestor's checkpoints)
        self._events_seen = 0
        self._refused: list[dict] = []  # writes the run's fence refused (reported with the checkpoint events)
        self.layouts = TrainerLayouts(self.work_dir, cell_gpus)  # what trains the run (single, fsdp2, DP, megatron)
        self._offload: tuple[PolicyTrainer, OptimizerOffload] | None = None  # setup.offload_optimizer
        self._published: tuple[str, int, str] | None = None  # (run, version, checksum) of the last export
        self._published_by: Trainer | None = None  # the trainer object that exported it

    # ---- setup and versions -------------------------------------------------------
    def _bind(self, setup: RunSetup) -> None:
        if self.trainer is not None and isinstance(self.trainer.health, Dead):  # a fsdp2 cell that lost a rank /
            self.layouts.discard_dead(self.trainer.health)  # every DP cell lost: rebuilt by restore + replay
            self.trainer = None
        if self.setup is not None and self.setup.run_id == setup.run_id and self.store is not None:
            self.setup = setup
            self.store.epoch, self.store.node = setup.epoch, setup.node_id  # this call's placement
            if self.saver is not None:
                self.saver.setup = setup  # its checkpoints record this placement's epoch
            return
        self._check_backend(setup)
        self.setup = setup
        self.trainer = None
        self.layouts.end_dp_group()  # another run's cells (a node rebinds between runs)
        # writes only under the run's own prefix, refused once the run's fence is past this call's epoch
        self.store = FencedStore(open_store(setup.store_uri), setup.run_id, setup.epoch, setup.node_id,
                                 on_refused=self._on_refused)
        self._events_seen = 0
        self.saver = CheckpointSaver(self.store, setup, self.work_dir, self._fenced_accept(setup.run_id))
        self.ckpts = self.saver.ckpts
        # read-only: a fork restores its ancestors' checkpoints but never saves or prunes there
        self.ancestors = [
            (a.step, CheckpointStore(self.store, art.checkpoints_prefix(a.run_id),
                                     local_dir=self.work_dir / setup.run_id / "ancestors" / a.run_id,
                                     accept=self._fenced_accept(a.run_id)))
            for a in setup.lineage
        ]

    @staticmethod
    def _check_backend(setup: RunSetup) -> None:
        """Refuse a run this trainer process cannot serve before it touches the run's store:
        ``trainer.backend megatron`` needs megatron-core and a CUDA trainer (a ValueError: the
        run fails as invalid input instead of retrying on the same node)."""
        if setup.trainer is not None and setup.trainer.backend == "megatron":
            if problem := runtime_problem():
                raise ValueError(problem)

    def _fenced_accept(self, run_id: str) -> Callable[[CheckpointInfo], bool]:
        """A checkpoint of ``run_id`` is durable state unless its writer's epoch was left
        behind by a placement that took over at or before its step."""
        def accept(info: CheckpointInfo) -> bool:
            assert self.store is not None
            return read_fence(self.store, run_id).accepts(info.step, int(info.meta.get("epoch", 0)))
        return accept

    def _on_refused(self, err: StaleEpoch) -> None:
        self._refused.append({"kind": "stale_write_refused", "node": self.store.node if self.store else "",
                              "epoch": err.epoch, "error": str(err)})

    def _owner(self, step: int) -> str:
        assert self.setup is not None
        return lineage.owner([(a.run_id, a.step) for a in self.setup.lineage], self.setup.run_id, step)

    def _durable_at_or_below(self, target: int) -> list[tuple[CheckpointInfo, CheckpointStore]]:
        """The run's checkpoints and (a fork) its ancestors' up to their last step, oldest
        first; at equal steps the run's own comes last (it is tried first)."""
        assert self.ckpts is not None
        found = [(c, anc) for last, anc in self.ancestors for c in anc.list_durable() if c.step <= min(last, target)]
        found += [(c, self.ckpts) for c in self.ckpts.list_durable() if c.step <= target]
        return sorted(found, key=lambda x: (x[0].step, x[1] is self.ckpts))

    def ensure_version(self, setup: RunSetup, target: int) -> VersionInfo:
        """Bring the trainer to ``target``: keep, or restore + replay, or SFT from scratch."""
        t0 = time.perf_counter()
        self._bind(setup)
        rebuild: Rebuild | None = None
        sft_metrics: dict[str, float] = {}
        if self.trainer is None or self.trainer.policy_version != target:
            restored, sft_metrics = self._restore_at_or_below(target)
            rebuild = Rebuild(restored_from_step=restored, replayed_steps=self._replay_to(target))
        info = self._publish_weights()
        return info.model_copy(update={
            "rebuild": rebuild, "sft_metrics": sft_metrics, "seconds": time.perf_counter() - t0,
            "events": self.new_events(), "cell": self.cell_state(), "dp": self.dp_state(),
        })

    def dp_state(self) -> DPCells | None:
        return self.layouts.dp_state(self.setup)

    def cell_state(self) -> CellInfo | None:
        return self.layouts.cell_state(self.setup)

    def new_events(self) -> list[RunEvent]:
        """Events not yet reported: the fsdp2 cell's (started, failed) and the checkpoint
        store's (corrupt checkpoint, failed upload, refused write)."""
        if self.ckpts is None:
            return []
        cells = self.layouts.take_events()
        events = self.ckpts.events[self._events_seen :]
        self._events_seen += len(events)
        events, self._refused = [*events, *self._refused], []
        now = time.time()
        return [*cells, *(
            RunEvent.at_time(now, str(e["kind"]), ", ".join(f"{k}={v}" for k, v in e.items() if k != "kind"))
            for e in events
        )]

    def _new_trainer(self) -> Trainer:
        assert self.setup is not None
        return self.layouts.new(self.setup, self._base_folder())

    def restart_cells(self, setup: RunSetup, indices: list[int]) -> CellsRestarted:
        """Start the given lost DP cells again (the workflow's heal, on its backoff schedule).
        Each heals from a peer in the next step's quorum. A cell that is not lost is left
        alone; with no live group there is nothing to heal (the next call builds all cells)."""
        self._bind(setup)
        outcome = self.layouts.restart_cells(setup, self.trainer, indices)
        return CellsRestarted(outcome=outcome, events=self.new_events(), dp=self.dp_state())

    def close(self) -> None:
        """End the processes behind the run's trainer (a fsdp2 cell's Ray, DP cells, the lighthouse)."""
        self.layouts.close()

    def _base_folder(self) -> Path:
        s = self.setup
        assert s is not None
        return base_model_folder(s.model, self._rows(), s.seed, self.work_dir / s.run_id)

    def _restore_at_or_below(self, target: int) -> tuple[int | None, dict[str, float]]:
        assert self.ckpts is not None and self.setup is not None and self.store is not None
        for info, ckpts in reversed(self._durable_at_or_below(target)):
            folder = Path(tempfile.mkdtemp(dir=self.work_dir, prefix="restore-"))
            try:
                got = ckpts.restore(folder, step=info.step)
                trainer = self._new_trainer()
                trainer.load_state(folder)
                self.trainer = trainer
                log.info("restored checkpoint step %d (v%d)", got.step, trainer.policy_version)
                return got.step, {}
            except CellFailed as err:  # the cell, not the checkpoint: an older one would not help
                self.layouts.cell_failed(err)
                raise
            except Exception as err:  # corrupt / missing: fall back to an older one
                log.warning("checkpoint step %d unusable: %s", info.step, err)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
                if ckpts is not self.ckpts:  # an ancestor's corrupt checkpoint is this run's event too
                    self.ckpts.events.extend(ckpts.events)
                    ckpts.events.clear()
        # nothing durable: deterministic SFT warm-up from the seed -> version 0
        s = self.setup
        trainer = self.layouts.sft_trainer(s, self._base_folder())
        rows = self._rows()
        metrics = trainer.sft_warmup(
            rows, s.sft.steps, s.sft.batch_size, s.sft.lr, s.seed, s.sft.grad_clip, betas=s.sft.betas)
        self.trainer = self.layouts.after_sft(s, trainer)
        self._publish_weights()  # checkpoint 0 uploads v0's model folder with it
        self.save_checkpoint(0, data_cursor=0, sync=True)
        return None, metrics

    def _rows(self) -> list[dict]:
        assert self.store is not None and self.setup is not None
        path = self.work_dir / self.setup.run_id / "dataset.jsonl"
        if not path.exists():
            self.store.get_file(self.setup.dataset_key, path)
        return load_jsonl(path)

    def _replay_to(self, target: int) -> list[int]:
        assert self.trainer is not None and self.store is not None and self.setup is not None
        replayed = []
        while self.trainer.policy_version < target:
            step = self.trainer.policy_version + 1
            key = art.step_batch_key(self._owner(step), step)
            if not self.store.exists(key):
                raise RuntimeError(f"cannot replay step {step}: {key} missing from the store")
            self._train(StepBatch.model_validate_json(self.store.get_bytes(key)), self._recorded_cells(step))
            replayed.append(step)
        if self.trainer.policy_version != target:
            raise RuntimeError(f"trainer at v{self.trainer.policy_version} is ahead of target v{target}")
        return replayed

    def _recorded_cells(self, step: int) -> int | None:
        """How many DP cells trained ``step`` when it committed (None: not a DP run, or not
        recorded): a replay splits the step the same way, so it is bitwise the original."""
        if layout(self.setup) != "dp":
            return None
        assert self.store is not None
        key = f"{art.step_prefix(self._owner(step), step)}/train_result.json"
        if not self.store.exists(key):
            return None
        cells = art.get_model(self.store, key, TrainResult).metrics.get("dp_cells")
        return int(cells) if cells else None

    def _weights_dir(self, version: int) -> Path:
        assert self.setup is not None
        return weights_folder(self.work_dir, self.setup.run_id, version)

    def _publish_weights(self) -> VersionInfo:
        """Export the current version as a model folder on this node's disk (the engines load
        it, hard-linked). Nothing goes to the store: a checkpoint uploads its version's folder
        (``save_checkpoint``), any other version is rebuilt when needed (checkpoint + replay)."""
        assert self.trainer is not None and self.store is not None and self.setup is not None
        v = self.trainer.policy_version
        folder = self._weights_dir(v)
        held = self._published_checksum(self.setup.run_id, v)
        if held is not None and self._published_by is self.trainer and read_meta(folder).get("checksum") == held:
            # this trainer exported it already
            return VersionInfo(policy_version=v, checksum=held, weights_key=art.weights_prefix(self.setup.run_id, v),
                               model_path=str(folder))
        checksum = self.trainer.export_model_folder(folder)
        lora = self.setup.model.lora
        if lora is not None and lora.export == "adapter":
            self.trainer.export_adapter_folder(folder / ADAPTER_DIR, self._published_base())
        # engines on this node only need the newest two versions locally
        prune_version_folders(folder.parent, v)
        self._published, self._published_by = (self.setup.run_id, v, checksum), self.trainer
        return VersionInfo(policy_version=v, checksum=checksum, weights_key=art.weights_prefix(self.setup.run_id, v),
                           model_path=str(folder))

    def _published_checksum(self, run_id: str, version: int) -> str | None:
        """The checksum of the last export when it is ``version`` of ``run_id``."""
        held = self._published
        return held[2] if held is not None and held[:2] == (run_id, version) else None

    def _published_base(self) -> str:
        """Where an adapter export's base model is: the user's ``model.path``, or a built
        base folder published once to ``runs/<run>/base/`` (its local path for a file:// store,
        its URI otherwise)."""
        assert self.store is not None and self.setup is not None
        if self.setup.model.path is not None:
            return str(Path(self.setup.model.path).expanduser().resolve())
        prefix = art.base_model_prefix(self.setup.run_id)
        if not self.store.exists(f"{prefix}/{DONE}"):
            base = self._base_folder()
            for f in sorted(p for p in base.iterdir() if p.is_file() and p.name != DONE):
                self.store.put_file(f"{prefix}/{f.name}", f)
            self.store.put_bytes(f"{prefix}/{DONE}", b"")  # last: the folder is complete
        inner = self.store.inner  # the fenced store's backing store: a local folder or S3
        return str(inner.root / prefix) if isinstance(inner, LocalStore) else inner.uri(prefix)

    # ---- weight broadcast (engines.weight_sync distributed) --------------------------
    def held_weights(self, run_id: str) -> HeldWeights:
        """The published version this trainer holds in memory for ``run_id``, if any."""
        held = self._published
        if self.trainer is None or held is None or held[0] != run_id or held[1] != self.trainer.policy_version:
            return HeldWeights()
        return HeldWeights(policy_version=held[1], checksum=held[2])

    def broadcast_weights(self, call: BroadcastWeightsCall) -> WeightsBroadcast:
        """Rank 0 of the push's group: broadcast the held version (refused, before
        joining, unless it is the one asked for)."""
        held = self.held_weights(call.run_id)
        if (held.policy_version, held.checksum) != (call.policy_version, call.checksum):
            raise ValueError(f"broadcast of v{call.policy_version} ({call.checksum[:12]}) refused: the trainer holds "
                             f"v{held.policy_version} ({(held.checksum or '')[:12]}) of run {call.run_id}")
        assert self.trainer is not None  # it holds the version
        state = self.trainer.broadcast_tensors(weights_folder(self.work_dir, call.run_id, call.policy_version))
        return weight_broadcast.broadcast(state, call)

    # ---- training -----------------------------------------------------------------
    def _train(self, batch: StepBatch, cells: int | None = None) -> dict[str, float]:
        assert self.trainer is not None and self.store is not None and self.setup is not None
        self._onload_optimizer()
        if batch.sft is not None:  # SFT mode: the rows at the step's data positions
            rows = self._rows()
            picked = prompts_for_step(len(rows), self.setup.seed, batch.sft.data_cursor, batch.sft.n_rows)
            return self.trainer.sft_step([rows[i] for i in picked], batch.hparams)
        samples, rewards = step_samples(self.store, batch)
        group = self.layouts.dp_group
        if cells is not None and group is not None and self.trainer is group:
            return group.train_step(samples, [r.reward for r in rewards], batch.group_size, batch.hparams,
                                    batch.temperature, forced_participants=cells)
        return self.trainer.train_step(samples, [r.reward for r in rewards], batch.group_size, batch.hparams,
                                       batch.temperature)

    def train_step(self, setup: RunSetup, batch: StepBatch) -> TrainResult:
        t0 = time.perf_counter()
        self._bind(setup)
        assert self.store is not None
        result_key = f"{art.step_prefix(setup.run_id, batch.step)}/train_result.json"
        if self.trainer is not None and self.trainer.policy_version == batch.policy_version + 1:
            if self.store.exists(result_key):  # a retry after success: never train twice
                return art.get_model(self.store, result_key, TrainResult)
        before: VersionInfo | None = None
        if self.trainer is None or self.trainer.policy_version != batch.policy_version:
            before = self.ensure_version(setup, batch.policy_version)
        art.put_model(self.store, art.step_batch_key(setup.run_id, batch.step), batch)
        faults.delay("train")
        try:
            metrics = self._train(batch)
        except FloatingPointError as err:
            self.trainer = None  # possibly half-updated: the next call restores a checkpoint
            raise Divergence(f"step {batch.step}: {err}") from err
        except Exception as err:
            if self.layouts.step_failed(setup, self.trainer, err):  # rebuilt by restore + replay
                self.trainer = None
            raise
        trained = time.perf_counter()
        info = self._publish_weights()
        log.info("step %d: trained in %.2fs, v%d exported in %.2fs", batch.step, trained - t0, info.policy_version,
                 time.perf_counter() - trained)
        if self.saver is not None:  # the next checkpoint's buffers, while the engines take this version
            self.saver.prepare(self.trainer)
        if setup.offload_optimizer:
            self._offload_optimizer()
        result = TrainResult(
            policy_version=info.policy_version,
            checksum=info.checksum,
            weights_key=info.weights_key,
            metrics=metrics,
            rebuild=before.rebuild if before else None,
            seconds=time.perf_counter() - t0,
            events=[*(before.events if before else []), *self.new_events()],
            cell=self.cell_state(),
            dp=self.dp_state(),
        )
        art.put_model(self.store, result_key, result)
        return result

    # ---- memory between phases (engines.release_memory) -----------------------------
    def _offload_optimizer(self) -> None:
        """The optimizer state to the host and the grads freed until the next ``_train``
        (a single-process trainer's; a fsdp2 cell or DP cells keep theirs)."""
        trainer = self.trainer
        if not isinstance(trainer, PolicyTrainer):
            return
        if self._offload is None or self._offload[0] is not trainer:  # a rebuilt trainer: new buffers
            self._offload = (trainer, OptimizerOffload())
        opts = [trainer.optimizer] + ([trainer.critic.optimizer] if trainer.critic is not None else [])
        moved = self._offload[1].offload(opts)
        log.info("optimizer state offloaded: %.1f MB in %.1f ms", moved / 1e6, self._offload[1].last_offload_s * 1e3)

    def _onload_optimizer(self) -> None:
        if self._offload is not None and self._offload[0] is self.trainer:
            self._offload[1].onload()
        elif self._offload is not None:  # the trainer was rebuilt (restored on the device): drop the old buffers
            self._offload = None

    def checkpoint(self, setup: RunSetup, request: CheckpointRequest) -> CheckpointSaved:
        """Save version ``request.step`` (restoring it first if this process lost it)."""
        faults.enospc("checkpoint", request.step)
        self._bind(setup)
        before: VersionInfo | None = None
        if self.trainer is None or self.trainer.policy_version != request.step:
            before = self.ensure_version(setup, request.step)
        faults.delay("checkpoint")
        saved = self.save_checkpoint(request.step, data_cursor=request.data_cursor, sync=request.sync)
        return saved.model_copy(update={
            "rebuild": before.rebuild if before else None,
            "events": [*(before.events if before else []), *self.new_events()],
        })

    def save_checkpoint(self, step: int, *, data_cursor: int, sync: bool = False) -> CheckpointSaved:
        """Checkpoint version ``step`` (``CheckpointSaver.save``: the step waits for a snapshot)."""
        assert self.trainer is not None and self.saver is not None
        if self.trainer.policy_version != step:
            raise RuntimeError(f"checkpoint step {step} but trainer holds v{self.trainer.policy_version}")
        return self.saver.save(self.trainer, step, data_cursor=data_cursor, sync=sync,
                               checksum=self._published_checksum(self.saver.run_id, step))

    def wait_for_uploads(self, timeout_s: float) -> bool:
        return True if self.ckpts is None else self.ckpts.wait_for_uploads(timeout_s)

    def forget_run(self, run_id: str, upload_wait_s: float = 300.0) -> RunForgotten:
        """A closed run: drop what this process holds for it (its files are reclaimed); a later call rebinds."""
        if self.setup is None or self.setup.run_id != run_id:
            return RunForgotten(run_id=run_id, held=False)
        uploaded = self.wait_for_uploads(upload_wait_s)
        self.layouts.end_dp_group()
        self.setup = self.trainer = self.store = self.ckpts = self.saver = self._offload = self._published = None
        self._published_by = None  # _bind resets the rest
        return RunForgotten(run_id=run_id, held=True, uploads_done=uploaded)
