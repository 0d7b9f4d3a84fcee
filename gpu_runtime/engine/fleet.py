"""A node's rollout engines: slots, parallel health checks, gated recovery, weight sync.

Each slot runs one engine subprocess (torch or SGLang backend). A background
``HealthMonitor`` probes every healthy engine *in parallel* with ``/health_generate``
(``/health``, which generates nothing, while the engines' memory is released);
``failure_threshold`` failed or timed-out probes in a row (or an exited process) make
the engine dead: it is SIGKILLed by pid (this also ends a SIGSTOPped engine), removed
from the router at once, and its slot becomes ``empty``. Empty slots are refilled only
by ``restart_empty_slots`` (the *gated recovery* that precedes a weight update), which
loads the newest weights and re-adds the engine to the router.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpu_runtime.engine.auth import check_exposure, engine_token
from gpu_runtime.engine.backends import EngineBackend
from gpu_runtime.engine import distributed_push
from gpu_runtime.engine.client import EngineClient, EngineError
from gpu_runtime.engine.distributed_push import Broadcaster, PushResult
from gpu_runtime.engine.fleet_memory import FleetMemoryPhases
from gpu_runtime.engine.fleet_types import (
    EventKind,
    FleetError,
    FleetEvent,
    HealthConfig,
    NoHealthyEngine,
    WeightMismatch,
    _Slot,
)
from gpu_runtime.engine.router import RouterError, RouterProcess
from gpu_runtime.engine.slots import SlotProcesses
from gpu_runtime.engine.weight_probe import TRUNCATE_ROWS, expected_probe, mismatched
from gpu_runtime.models.model_folder import read_meta
from gpu_runtime.proc.processes import free_port
from gpu_runtime.weight_sync.distributed import DEFAULT_BUCKET_BYTES
from gpu_runtime.weight_sync.shared_memory import NodeSegments, Segment
from spec.status import EngineSlotInfo

log = logging.getLogger(__name__)


class EngineFleet(FleetMemoryPhases):
    def __init__(
        self,
        backend: EngineBackend,
        num_slots: int,
        model_path: str | Path,
        base_port: int,
        log_dir: str | Path,
        router: RouterProcess | None = None,
        health: HealthConfig | None = None,
        *,
        weight_version: int | str | None = None,
        on_event: Callable[[FleetEvent], None] | None = None,
        generate_timeout_s: float = 600.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.backend = backend
        self.model_path = str(model_path)
        self.weight_version = None if weight_version is None else str(weight_version)
        self.log_dir = Path(log_dir)
        self.router = router
        self.health = health or HealthConfig()
        self.on_event = on_event
        self.generate_timeout_s = generate_timeout_s
        check_exposure(host, engine_token(), "engine")  # before any engine is spawned
        self.slots = [_Slot(i, f"http://{host}:{base_port + i}", base_port + i) for i in range(num_slots)]
        self.events: list[FleetEvent] = []
        self._lock = threading.RLock()
        self._clients: dict[str, EngineClient] = {}
        self._rr = itertools.count()
        self._pool = ThreadPoolExecutor(max_workers=max(4, num_slots), thread_name_prefix="fleet")
        self._stop = threading.Event()
        self._procs = SlotProcesses(backend, self.log_dir, host, self.health, self._lock, self._stop)
        self._monitor: threading.Thread | None = None
        self._owns_router = False
        self._segments = NodeSegments(f"fleet{base_port}")  # engines.weight_sync shared_memory
        self._init_memory_phases()  # engines.release_memory (fleet_memory.py)
        self.last_push: PushResult | None = None  # engines.weight_sync distributed: the last push's outcome

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for s in self.slots:
            self._procs.spawn(s, self.model_path, self.weight_version)
        ok = self._procs.wait_all_healthy(self.slots)
        if not all(ok):
            bad = [s.index for s, good in zip(self.slots, ok) if not good]
            self.stop()
            raise FleetError(f"engines in slots {bad} did not become healthy; logs in {self.log_dir}")
        if self.router is not None:
            if self.router.proc is None:
                self.router.initial_workers = []
                self.router.start()
                self._owns_router = True
            self.router.sync(self.healthy_urls())
        self._stop.clear()
        self._monitor = threading.Thread(target=self._monitor_loop, name="HealthMonitor", daemon=True)
        self._monitor.start()

    def stop(self) -> None:
        self._segments.close()
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=self.health.timeout_s + 5)
            self._monitor = None
        for s in self.slots:
            self._procs.kill(s)
            s.state = "empty"
        if self.router is not None and self._owns_router:
            self.router.stop()
            self._owns_router = False
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    def __enter__(self) -> "EngineFleet":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- queries ---------------------------------------------------------------------
    def healthy_urls(self) -> list[str]:
        with self._lock:
            return [s.url for s in self.slots if s.state == "healthy"]

    def snapshot(self) -> list[EngineSlotInfo]:
        """Every slot as the run's status shows it (a version that is no number: None)."""
        with self._lock:
            return [
                EngineSlotInfo(slot=s.index, pid=s.proc.pid if s.proc else None, url=s.url, state=s.state,
                               weight_version=int(s.weight_version) if (s.weight_version or "").isdigit() else None,
                               checksum=s.checksum, restart_count=s.restart_count)
                for s in self.slots
            ]

    # ---- slots and events ------------------------------------------------------------
    def _client(self, url: str) -> EngineClient:
        with self._lock:
            if url not in self._clients:
                self._clients[url] = self.backend.client(url, self.generate_timeout_s)
            return self._clients[url]

    def kill_slot(self, i: int, detail: str = "killed by request") -> None:
        self._declare_dead(self.slots[i], detail, hung=False)

    def _declare_dead(self, s: _Slot, detail: str, *, hung: bool) -> None:
        with self._lock:
            if s.state not in ("healthy", "starting"):
                return
            s.state = "dead"
            pid = s.proc.pid if s.proc else None
        try:
            if hung:
                self._emit("engine_hung", s.index, detail)
            self._procs.kill(s)
            if self.router is not None:
                try:
                    self.router.remove_worker(s.url)
                except (RouterError, ValueError) as e:
                    log.warning("slot %d: could not remove %s from router: %s", s.index, s.url, e)
        finally:  # a slot left "dead" would never be restarted (recovery restarts "empty" slots)
            with self._lock:
                s.state, s.weight_version, s.checksum, s.failures = "empty", None, None, 0
        # emitted once the engine is killed, reaped and out of the router
        self._emit("engine_dead", s.index, f"pid={pid}: {detail}")

    def _emit(self, kind: EventKind, slot: int, detail: str = "") -> None:
        ev = FleetEvent(kind=kind, slot=slot, at=time.time(), detail=detail)
        with self._lock:
            self.events.append(ev)
        log.info("fleet event %s slot=%d %s", kind, slot, detail)
        if self.on_event is not None:
            try:
                self.on_event(ev)
            except Exception:  # noqa: BLE001 - a callback must not break health checking
                log.exception("on_event callback failed")

    # ---- health ----------------------------------------------------------------------
    def _monitor_loop(self) -> None:
        while not self._stop.wait(self.health.interval_s):
            try:
                self.check_now()
            except Exception:  # noqa: BLE001 - keep monitoring
                log.exception("health sweep failed")

    def _probe(self, s: _Slot) -> tuple[_Slot, bool, bool, str]:
        """``/health_generate`` (a one-token generation on SGLang); while released ``/health``:
        a generation on released memory (SGLang) is what must not happen."""
        c = self.backend.client(s.url, self.health.timeout_s)
        try:
            if self.released:
                c.check_health(self.health.timeout_s)
            else:
                c.check_health_generate(self.health.timeout_s)
            return s, True, False, ""
        except EngineError as e:
            return s, False, e.timeout, str(e)
        finally:
            c.close()

    def check_now(self) -> None:
        """One sweep: reap exited engines, then probe all healthy engines in parallel."""
        with self._phase:
            self._sweep()

    def _sweep(self) -> None:
        for s in list(self.slots):
            proc = s.proc
            if s.state == "healthy" and proc is not None and proc.poll() is not None:
                self._declare_dead(s, f"process exited rc={proc.returncode}", hung=False)
        targets = [s for s in self.slots if s.state == "healthy"]
        for s, ok, timed_out, detail in self._pool.map(self._probe, targets):
            if ok:
                s.failures = 0
                continue
            s.failures += 1
            log.warning("slot %d: probe failed (%d/%d): %s", s.index, s.failures,
                        self.health.failure_threshold, detail)
            if s.failures >= self.health.failure_threshold:
                self._declare_dead(s, f"health_generate failed: {detail}", hung=timed_out)

    # ---- recovery and weights --------------------------------------------------------
    def resize(self, n: int) -> None:
        """``engines.num_engines`` changed mid-run: shrink stops the highest slots (out of the
        router first, so no request is routed to a dying engine); grow adds empty slots on
        free ports, which ``restart_empty_slots`` starts with the newest weights, gated and
        checksum-verified like any recovery."""
        if n < 1:
            raise ValueError(f"engines.num_engines must be >= 1, got {n}")
        with self._lock:
            gone, self.slots = self.slots[n:], self.slots[:n]
            host = self.slots[0].url.rsplit(":", 1)[0]
            ports = [free_port() for _ in range(n - len(self.slots))]
            self.slots += [_Slot(len(self.slots) + i, f"{host}:{p}", p, added=True) for i, p in enumerate(ports)]
        for s in gone:
            if self.router is not None:
                self.router.remove_worker(s.url)
            self._procs.kill(s)
            s.state = "empty"
            self._emit("engine_removed", s.index, f"num_engines {n}")
        for s in self.slots:
            if s.added:
                self._emit("engine_added", s.index, f"num_engines {n}: port {s.port}")
        if n > self._pool._max_workers:  # one thread per slot for a chunk fan-out
            old, self._pool = self._pool, ThreadPoolExecutor(max_workers=n, thread_name_prefix="fleet")
            old.shutdown(wait=False)

    def restart_empty_slots(self, model_path: str | Path | None = None, version: int | str | None = None) -> list[int]:
        """Gated recovery: start engines in empty slots with the given (newest) weights,
        wait until healthy, verify the checksum and re-add them to the router (slots that
        ``resize`` added start here the same way)."""
        if model_path is not None:
            self.model_path = str(model_path)
            self.weight_version = None if version is None else str(version)
        empty = [s for s in self.slots if s.state == "empty"]
        for s in empty:
            with self._lock:
                s.restart_count += not s.added
                added, s.added = s.added, False
            self._procs.spawn(s, self.model_path, self.weight_version)
            if not added:
                self._emit("engine_restarted", s.index, f"pid={s.proc.pid if s.proc else None} {self.model_path}")
        ok = self._procs.wait_all_healthy(empty)
        expected = self._expected_checksum(self.model_path)
        recovered: list[int] = []
        for s, good in zip(empty, ok):
            if not good:
                self._declare_dead(s, "did not become healthy after restart", hung=False)
                continue
            if not self.backend.supports_checksum:  # no hash (SGLang): the sampled-parameter probe
                s.checksum, got = self._probe_verified(s, self.model_path)
                bad = s.checksum is None
            else:
                got, bad = f"got {s.checksum} want {expected}", expected is not None and s.checksum != expected
            if bad:
                self._emit("checksum_mismatch", s.index, got)
                self._declare_dead(s, "checksum mismatch after restart", hung=False)
                continue
            if self.router is not None:
                self.router.remove_worker(s.url)  # a stale entry would sit behind the circuit breaker
                self.router.add_worker(s.url)
            self._emit("engine_recovered", s.index, f"version={s.weight_version}")
            recovered.append(s.index)
        return recovered

    def _probe_mismatch(self, s: _Slot, model_path: str) -> list[str]:
        """Parameters whose sampled values on the engine differ from the folder's."""
        expected = expected_probe(model_path)
        client = self._client(s.url)
        got = {}
        for name in expected:
            try:
                got[name] = client.get_weights_by_name(name, truncate_size=TRUNCATE_ROWS)
            except EngineError as e:
                log.warning("slot %d: get_weights_by_name(%s) failed: %s", s.index, name, e)
        return mismatched(expected, got)

    def _probe_verified(self, s: _Slot, model_path: str) -> tuple[str | None, str]:
        """(the folder's checksum, which a verified engine stands for since its sampled
        parameters are the folder's; or None) and what the event says."""
        wrong = self._probe_mismatch(s, model_path)
        if wrong:
            return None, f"probe mismatch: {', '.join(wrong)}"
        checksum = read_meta(model_path).get("checksum")
        return checksum, f"{checksum} (folder's; sampled parameters verified)"

    def _expected_checksum(self, model_path: str) -> str | None:
        if not self.backend.supports_checksum:
            return None
        return read_meta(model_path).get("checksum")

    def update_weights(
        self, model_path: str | Path, version: int | str, sync: str = "store", broadcaster: Broadcaster | None = None,
    ) -> dict[int, str]:
        """Push weights to every healthy engine in parallel, then verify that every engine
        reports the expected checksum (the folder's meta, else the first engine's).
        ``sync`` ``shared_memory`` (torch engines): the folder is read once into a shared
        memory segment the engines load from (``gpu_runtime.weight_sync``); ``distributed``:
        the trainer (``broadcaster``) broadcasts the version to the engines over a
        torch.distributed group formed for this push, and the engines it did not reach load
        the folder from disk (a ``weight_sync_fallback`` event each).
        Returns {slot: checksum}; raises WeightMismatch naming the disagreeing slots."""
        path, ver = str(model_path), str(version)
        targets = [s for s in self.slots if s.state == "healthy"]
        if not targets:
            raise NoHealthyEngine(f"no healthy engine to update (slots: {[s.state for s in self.slots]})")
        if sync == "distributed" and broadcaster is None:
            raise ValueError("update_weights: sync distributed needs a broadcaster (the trainer's)")
        seg = self._segments.publish_folder(path, ver) if sync == "shared_memory" else None
        from_disk = targets
        if sync == "distributed":
            assert broadcaster is not None
            from_disk = self._push_distributed(targets, path, ver, broadcaster)
        self._load_weights(from_disk, path, ver, seg)
        self.model_path, self.weight_version = path, ver
        verified = self._verify_weights([s for s in targets if s.state == "healthy"], path, ver)
        self.push_pending = False
        return verified

    def _push_distributed(self, targets: list[_Slot], path: str, ver: str, broadcaster: Broadcaster) -> list[_Slot]:
        """The trainer broadcasts version ``ver`` to ``targets``; the slots it did not reach
        (a ``weight_sync_fallback`` event each), which load it from disk instead."""
        res = distributed_push.push([s.url for s in targets], path, ver, read_meta(path).get("checksum"),
                                    broadcaster, send_checksum=self.backend.supports_checksum,
                                    request_timeout_s=self.generate_timeout_s,
                                    ranks_per_engine=int(getattr(self.backend, "tp_size", 1)),
                                    bucket_bytes=DEFAULT_BUCKET_BYTES if self.backend.supports_checksum else 0)
        self.last_push = res
        from_disk = [s for s in targets if s.url not in res.updated]
        for s in from_disk:
            self._emit("weight_sync_fallback", s.index,
                       f"version={ver}: distributed push failed ({res.failed.get(s.url)}"
                       f"{'; trainer: ' + res.trainer_error if res.trainer_error else ''}): loading from disk")
        return from_disk

    def _load_weights(self, slots: list[_Slot], path: str, ver: str, seg: Segment | None) -> None:
        """Each slot loads version ``ver`` (from the shared memory segment ``seg``, else from the
        folder ``path``), in parallel; a slot that fails is declared dead."""

        def load(s: _Slot) -> str | None:
            c = self.backend.client(s.url, self.generate_timeout_s)
            try:
                if seg is not None:
                    c.update_weights_from_shared_memory(str(seg.path), ver, seg.checksum)
                else:
                    c.update_weights_from_disk(path, ver)
                return None
            except EngineError as e:
                return str(e)
            finally:
                c.close()

        for s, err in zip(slots, self._pool.map(load, slots)):
            if err is not None:
                self._declare_dead(s, f"weight update failed: {err}", hung=False)

    def _verify_weights(self, targets: list[_Slot], path: str, ver: str) -> dict[int, str]:
        """Every target's reported weights against version ``ver`` and the expected checksum (a
        ``checksum_ok`` / ``checksum_mismatch`` event each): {slot: checksum}, or WeightMismatch."""
        reports = list(self._pool.map(lambda s: self._procs.read_weights(self._client(s.url)), targets))
        expected = self._expected_checksum(path)
        if expected is None and self.backend.supports_checksum and reports:
            expected = reports[0][1]
        bad: list[int] = []
        out: dict[int, str] = {}
        for s, (got_ver, got_sum) in zip(targets, reports):
            good = got_ver == ver and (expected is None or got_sum == expected)
            detail = got_sum
            if good and not self.backend.supports_checksum:  # no full hash: spot-check sampled parameters
                got_sum, detail = self._probe_verified(s, path)
                good = got_sum is not None
            with self._lock:
                s.weight_version, s.checksum = got_ver, got_sum
            self._emit("checksum_ok" if good else "checksum_mismatch", s.index, f"version={got_ver} checksum={detail}")
            if not good:
                bad.append(s.index)
            out[s.index] = got_sum or ""
        if bad:
            raise WeightMismatch(bad, f"expected version={ver} checksum={expected}")
        return out

    # ---- generation ------------------------------------------------------------------
    def generate_chunk(
        self, batch: list[list[int]], sampling_params: dict[str, Any], *, return_logprob: bool = True,
        max_attempts: int | None = None,
    ) -> tuple[list[dict[str, Any]], str]:
        """Send one chunk (one batch request) to a healthy engine; on an engine failure,
        detect it and resend the SAME request (same seeds) to a survivor."""
        self.push_if_pending()
        params = self.backend.batch_sampling_params(sampling_params, len(batch))
        # sglang-router 0.3.2 refuses a list of sampling params (HTTP 422, measured): such a
        # chunk (SGLang's, one seed per sample) goes to an engine directly, round-robin
        via_router = self.router is not None and isinstance(params, dict)
        attempts = max_attempts or len(self.slots) + 2
        last: EngineError | None = None
        for _ in range(attempts):
            healthy = self.healthy_urls()
            if not healthy:
                raise NoHealthyEngine(f"no healthy engine (slots: {[s.state for s in self.slots]})") from last
            url = self.router.url if via_router and self.router else healthy[next(self._rr) % len(healthy)]
            try:
                return self._client(url).generate(batch, params, return_logprob), url
            except EngineError as e:
                if e.status is not None and 400 <= e.status < 500 and e.status not in (404, 408, 429):
                    raise  # the request itself is bad: retrying elsewhere cannot help
                last = e
                log.warning("chunk failed on %s: %s; detecting failures and retrying", url, e)
                if via_router:
                    self.check_now()
                else:
                    s = next(x for x in self.slots if x.url == url)
                    _, ok, timed_out, detail = self._probe(s)
                    if not ok:
                        self._declare_dead(s, f"request failed and probe failed: {detail}", hung=timed_out)
        raise NoHealthyEngine(f"chunk failed {attempts} times") from last
