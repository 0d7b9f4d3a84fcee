"""Everything a node agent owns, one part per job: its trainer process, the engines of the
run it serves (``NodeEngines``: fleet, router, tokenizer), the version folders those
engines load (``LocalWeights``), the run's dataset rows and the rollouts' held chunks.

One run is served at a time; a claim by another run rebinds the node (the trainer
restores that run's state by checkpoint + replay).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from gpu_runtime.node.children_file import remove_children, write_children
from gpu_runtime.node.engines import NodeEngines
from gpu_runtime.node.local_weights import LocalWeights
from gpu_runtime.node.rows import DatasetRows
from gpu_runtime.proc.devices import Placement
from gpu_runtime.rollout.held import HeldChunks
from gpu_runtime.trainer.process import TrainerProcess
from gpu_runtime.weight_sync.member_push import GroupMember
from gpu_runtime.weight_sync.shared_memory import prune_orphans
from gpu_runtime.rollout.agent.agent_process import ZYGOTES
from spec.engine import EngineSpec
from spec.events import RunEvent
from spec.trainer_rpc import RunSetup

log = logging.getLogger(__name__)

CPU_ONLY = Placement("cpu", ("cpu",))


class NodeRuntime:
    def __init__(
        self, node_id: str, boot_id: str, work_dir: Path, *, engine_threads: int = 1, trainer_threads: int = 1,
        placement: Placement = CPU_ONLY, trains: bool = True,
    ) -> None:
        self.node_id = node_id
        self.trains = trains  # False: a rollout-only agent (``--role rollout``): no trainer process
        self.weights_url = ""  # this node's weight server, once started (``workers.gpu``)
        self.boot_id = boot_id
        self.work_dir = work_dir
        self.placement = placement
        self.trainer = TrainerProcess(
            work_dir / "trainer", work_dir / "logs" / "trainer.log", threads=trainer_threads, on_event=self._add_event,
            device=placement.trainer, cell_gpus=placement.cell_gpus,
        )
        self.engines = NodeEngines(work_dir, placement, engine_threads, self.trainer.broadcaster, self._add_event)
        self.local_weights = LocalWeights(self.trainer.work_dir)
        self.datasets = DatasetRows(work_dir)
        self.held = HeldChunks()  # the rollouts' chunks until their rewards are scored here
        self.run_id: str | None = None
        self.setups: dict[str, RunSetup] = {}  # run id -> what its trainer needs
        self._undrained: list[RunEvent] = []
        self._events_lock = threading.Lock()  # fleet callbacks arrive while the engines' lock is held

    @property
    def task_queue(self) -> str:
        return f"node-{self.node_id}-{self.boot_id}"

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        prune_orphans()  # weight segments of an agent killed on this machine (engines.weight_sync)
        if self.trains:
            self.trainer.start()
        self._write_children()

    def stop(self) -> None:
        self.engines.stop()
        if self.trains:
            self.trainer.stop()
        ZYGOTES.close()  # kind openai agents' zygotes (and, through them, their episodes)
        remove_children(self.work_dir)

    def _write_children(self) -> None:
        """Child pids on disk (``children_file``), so ``make down`` can stop them even if this
        process was killed, and a test can aim a kill."""
        router, engines = self.engines.pids()
        write_children(self.work_dir, trainer=self.trainer.pid if self.trains else None, router=router, engines=engines)

    def _add_event(self, ev: RunEvent) -> None:
        with self._events_lock:
            self._undrained.append(ev)

    def drain_events(self) -> list[RunEvent]:
        """Events of the fleet and the trainer process since the last drain (reported in
        the next activity result)."""
        with self._events_lock:
            out, self._undrained = self._undrained, []
        return out

    # ---- the run's engines (their pids written down whenever they may have changed) ----
    def ensure_engines(
        self, spec: EngineSpec, model_path: Path, version: int, run_id: str, member: GroupMember | None = None,
    ) -> list[int]:
        """The run's engines (``spec``) serving the version at ``model_path`` (``member``: started
        from it, then given ``member.version`` by the trainer's group): the slots (re)started."""
        restarted = self.engines.ensure(spec, model_path, version, run_id or self.run_id or "", member)
        self._write_children()
        return restarted

    def recover_engines(self) -> list[int]:
        """Restart empty slots with the weights the fleet last served (no engine alive)."""
        if self.engines.fleet is None:
            return []
        # a version the engines got from the trainer's group is pulled now: the restarted ones load it
        self.local_weights.materialize(Path(self.engines.fleet.model_path))
        restarted = self.engines.recover()
        self._write_children()
        return restarted

    def set_run(self, run_id: str) -> None:
        if self.run_id not in (None, run_id):
            log.warning("node %s rebinds from run %s to %s", self.node_id, self.run_id, run_id)
        self.run_id = run_id
