"""Which run the trainer process serves, for which placement, and what it holds for it.

A ``RunBinding`` exists only once a call has named its run (``TrainerService._bind``): the
run's setup, its store (fenced: writes only under the run's own prefix, refused once the
run's fence is past this call's epoch), its checkpointer (``CheckpointSaver``), a fork's
ancestors' checkpoints (read only), and the trainer once one is built. A later call of
the same run moves it to that call's placement (``rebind``); another run's call makes a new one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from gpu_runtime.data.datasets import load_jsonl
from gpu_runtime.store import artifacts as art, lineage
from gpu_runtime.store.checkpoint_manifest import CheckpointInfo
from gpu_runtime.store.checkpoint_store import CheckpointStore
from gpu_runtime.store.fence import FencedStore, StaleEpoch, read_fence
from gpu_runtime.store.uri import open_store
from gpu_runtime.trainer.base_model import base_model_folder
from gpu_runtime.trainer.checkpoint_saver import CheckpointSaver
from gpu_runtime.trainer.protocol import Trainer
from gpu_runtime.trainer.work_dir import weights_folder
from spec.events import RunEvent, StaleWriteRefused, utc_now
from spec.trainer_rpc import RunSetup, TrainResult


class RunBinding:
    def __init__(self, setup: RunSetup, work_dir: Path) -> None:
        self.setup = setup
        self.work_dir = work_dir
        self.trainer: Trainer | None = None  # None: built by restore + replay (or SFT) at the next call
        self._refused: list[RunEvent] = []  # writes the run's fence refused (reported with the checkpoint events)
        self._events_seen = 0  # of the checkpoint store's events
        # writes only under the run's own prefix, refused once the run's fence is past this call's epoch
        self.store = FencedStore(open_store(setup.store_uri), setup.run_id, setup.epoch, setup.node_id,
                                 on_refused=self._on_refused)
        # the run's checkpoints: snapshot now, write and upload after
        self.saver = CheckpointSaver(self.store, setup, work_dir, self._fenced_accept(setup.run_id))
        self.ckpts: CheckpointStore = self.saver.ckpts
        # read-only: a fork restores its ancestors' checkpoints but never saves or prunes there
        self.ancestors: list[tuple[int, CheckpointStore]] = [  # (last step, the ancestor's checkpoints)
            (a.step, CheckpointStore(self.store, art.checkpoints_prefix(a.run_id),
                                     local_dir=work_dir / setup.run_id / "ancestors" / a.run_id,
                                     accept=self._fenced_accept(a.run_id)))
            for a in setup.lineage
        ]

    @property
    def run_id(self) -> str:
        return self.setup.run_id

    def rebind(self, setup: RunSetup) -> None:
        """A later call of the same run: its placement (epoch, node) from now on."""
        self.setup = setup
        self.store.epoch, self.store.node = setup.epoch, setup.node_id
        self.saver.setup = setup  # its checkpoints record this placement's epoch

    # ---- fencing -------------------------------------------------------------------
    def _fenced_accept(self, run_id: str) -> Callable[[CheckpointInfo], bool]:
        """A checkpoint of ``run_id`` is durable state unless its writer's epoch was left
        behind by a placement that took over at or before its step."""
        def accept(info: CheckpointInfo) -> bool:
            return read_fence(self.store, run_id).accepts(info.step, int(info.meta.get("epoch", 0)))
        return accept

    def _on_refused(self, err: StaleEpoch) -> None:
        self._refused.append(StaleWriteRefused(at=utc_now(), node=self.store.node, epoch=err.epoch, error=str(err)))

    # ---- the run's data ------------------------------------------------------------
    def owner(self, step: int) -> str:
        """The run whose folder holds ``step``'s artifacts (a fork's ancestor, up to its last step)."""
        return lineage.owner([(a.run_id, a.step) for a in self.setup.lineage], self.setup.run_id, step)

    def durable_at_or_below(self, target: int) -> list[tuple[CheckpointInfo, CheckpointStore]]:
        """The run's checkpoints and (a fork) its ancestors' up to their last step, oldest
        first; at equal steps the run's own comes last (it is tried first)."""
        found = [(c, anc) for last, anc in self.ancestors for c in anc.list_durable() if c.step <= min(last, target)]
        found += [(c, self.ckpts) for c in self.ckpts.list_durable() if c.step <= target]
        return sorted(found, key=lambda x: (x[0].step, x[1] is self.ckpts))

    def rows(self) -> list[dict]:
        """The run's dataset (fetched once into the run's folder)."""
        path = self.work_dir / self.setup.run_id / "dataset.jsonl"
        if not path.exists():
            self.store.get_file(self.setup.dataset_key, path)
        return load_jsonl(path)

    def base_folder(self) -> Path:
        """The model folder the run starts from (built the same on every node)."""
        s = self.setup
        return base_model_folder(s.model, self.rows(), s.seed, self.work_dir / s.run_id)

    def committed_metrics(self, step: int) -> dict[str, float]:
        """The metrics of ``step``'s stored train result ({} when not recorded): how a replay
        splits the step so that it is bitwise the original (``Trainer.replay_step``)."""
        key = f"{art.step_prefix(self.owner(step), step)}/train_result.json"
        if not self.store.exists(key):
            return {}
        return art.get_model(self.store, key, TrainResult).metrics

    def weights_dir(self, version: int) -> Path:
        """Where this node's trainer exports ``version`` of the run."""
        return weights_folder(self.work_dir, self.setup.run_id, version)

    # ---- reports -------------------------------------------------------------------
    def absorb_events(self, ckpts: CheckpointStore) -> None:
        """An ancestor's checkpoint events (a corrupt checkpoint) are this run's too."""
        if ckpts is not self.ckpts:
            self.ckpts.events.extend(ckpts.events)
            ckpts.events.clear()

    def new_events(self, cells: list[RunEvent]) -> list[RunEvent]:
        """``cells``' events and the checkpoint store's not yet reported (corrupt checkpoint,
        failed upload, full disk), then the writes the fence refused."""
        events = self.ckpts.events[self._events_seen :]
        self._events_seen += len(events)
        events, self._refused = [*events, *self._refused], []
        return [*cells, *events]


__all__ = ["RunBinding"]
