"""Publishing a version: the trainer's weights exported as a model folder on this node's disk
(the engines load it, hard-linked), its checksum, an adapter folder under LoRA's ``export:
adapter``, and the last published version held for a broadcast to the engines.

Nothing goes to the store here: a checkpoint uploads its version's folder
(``CheckpointSaver``), any other version is rebuilt when needed (checkpoint + replay). The
version folders of a run on this node are pruned to the newest two.
"""

from __future__ import annotations

from pathlib import Path

from gpu_runtime.models.model_folder import prune_version_folders, read_meta
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.object_store import LocalStore
from gpu_runtime.trainer import weight_broadcast
from gpu_runtime.trainer.base_model import DONE
from gpu_runtime.trainer.protocol import Trainer
from gpu_runtime.trainer.run_binding import RunBinding
from gpu_runtime.trainer.work_dir import weights_folder
from spec.trainer_rpc import BroadcastWeightsCall, HeldWeights, VersionInfo, WeightsBroadcast

ADAPTER_DIR = "adapter"  # an adapter export's folder inside each published version


class VersionPublisher:
    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self._published: tuple[str, int, str] | None = None  # (run, version, checksum) of the last export
        self._published_by: Trainer | None = None  # the trainer object that exported it

    def publish(self, run: RunBinding, trainer: Trainer) -> VersionInfo:
        """Export ``trainer``'s version as a model folder on this node's disk, unless this
        trainer exported it already."""
        v = trainer.policy_version
        folder = run.weights_dir(v)
        held = self.checksum(run.run_id, v)
        if held is not None and self._published_by is trainer and read_meta(folder).get("checksum") == held:
            # this trainer exported it already
            return VersionInfo(policy_version=v, checksum=held, model_path=str(folder))
        checksum = trainer.export_model_folder(folder)
        lora = run.setup.model.lora
        if lora is not None and lora.export == "adapter":
            trainer.export_adapter_folder(folder / ADAPTER_DIR, self._published_base(run))
        # engines on this node only need the newest two versions locally
        prune_version_folders(folder.parent, v)
        self._published, self._published_by = (run.run_id, v, checksum), trainer
        return VersionInfo(policy_version=v, checksum=checksum, model_path=str(folder))

    def checksum(self, run_id: str, version: int) -> str | None:
        """The checksum of the last export when it is ``version`` of ``run_id``."""
        held = self._published
        return held[2] if held is not None and held[:2] == (run_id, version) else None

    def _published_base(self, run: RunBinding) -> str:
        """Where an adapter export's base model is: the user's ``model.path``, or a built
        base folder published once to ``runs/<run>/base/`` (its local path for a file:// store,
        its URI otherwise)."""
        if run.setup.model.path is not None:
            return str(Path(run.setup.model.path).expanduser().resolve())
        prefix = art.base_model_prefix(run.run_id)
        if not run.store.exists(f"{prefix}/{DONE}"):
            base = run.base_folder()
            for f in sorted(p for p in base.iterdir() if p.is_file() and p.name != DONE):
                run.store.put_file(f"{prefix}/{f.name}", f)
            run.store.put_bytes(f"{prefix}/{DONE}", b"")  # last: the folder is complete
        inner = run.store.inner  # the fenced store's backing store: a local folder or S3
        return str(inner.root / prefix) if isinstance(inner, LocalStore) else inner.uri(prefix)

    # ---- weight broadcast (engines.weight_sync distributed) --------------------------
    def held(self, run_id: str, trainer: Trainer | None) -> HeldWeights:
        """The published version ``trainer`` holds in memory for ``run_id``, if any."""
        held = self._published
        if trainer is None or held is None or held[0] != run_id or held[1] != trainer.policy_version:
            return HeldWeights()
        return HeldWeights(policy_version=held[1], checksum=held[2])

    def broadcast(self, call: BroadcastWeightsCall, trainer: Trainer | None) -> WeightsBroadcast:
        """Rank 0 of the push's group: broadcast the held version (refused, before
        joining, unless it is the one asked for)."""
        held = self.held(call.run_id, trainer)
        if trainer is None or (held.policy_version, held.checksum) != (call.policy_version, call.checksum):
            raise ValueError(f"broadcast of v{call.policy_version} ({call.checksum[:12]}) refused: the trainer holds "
                             f"v{held.policy_version} ({(held.checksum or '')[:12]}) of run {call.run_id}")
        state = trainer.broadcast_tensors(weights_folder(self.work_dir, call.run_id, call.policy_version))
        return weight_broadcast.broadcast(state, call)

    def forget(self) -> None:
        """A closed run: no version is held any more."""
        self._published = self._published_by = None


__all__ = ["ADAPTER_DIR", "VersionPublisher"]
