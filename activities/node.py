"""Stateful activities served by a node agent on ``node-<node_id>-<boot_id>``.

Thin adapters: validate, call ``gpu_runtime``, heartbeat, map failures to
retryable / non-retryable errors.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from temporalio import activity
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from activities import rewards, translate
from activities.disk import disk_full_failure
from activities.heartbeat import with_heartbeat
from gpu_runtime.engine.auth import check_exposure, engine_token, is_loopback
from gpu_runtime.engine.backends import SGLangEngineBackend, vllm_python
from gpu_runtime.engine.fleet import EngineFleet
from gpu_runtime.engine.fleet_types import HealthConfig, NoHealthyEngine, WeightMismatch
from gpu_runtime.engine.weight_probe import unverifiable_reason
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.node.runtime import NodeRuntime
from gpu_runtime.proc import metrics
from gpu_runtime.proc.rpc import RemoteError
from gpu_runtime.rollout.agent.tools import ToolNotFound
from gpu_runtime.rollout.chunks import NonFiniteLogprobs, RolloutContext, StaleWeights
from gpu_runtime.rollout.dispatch import RolloutStats, run_rollout
from gpu_runtime.rollout.evaluate import run_eval
from gpu_runtime.store.fence import FencedStore, StaleEpoch, next_epoch, raise_fence
from gpu_runtime.store.uri import open_store
from gpu_runtime.trainer.process import TrainerDied
from spec.status import DPCells, RunEvent
from spec.trainer_rpc import RunSetup
from workflows.contracts.cells import RestartCellsInput, RestartCellsResult
from workflows.contracts.placement import ClaimNodeInput, InitPolicyInput, NodeClaim, NodeLivenessInput, PolicyInfo
from workflows.contracts.sampling import RewardInput, RewardResult, RolloutInput, RolloutResult
from workflows.contracts.training import (
    CheckpointInput, CheckpointResult, EvalInput, EvalResult, TrainStepInput, TrainStepResult, UpdateWeightsInput,
    UpdateWeightsResult,
)
from workflows.failures import Failure, failure
from workflows.stubs import (
    CHECKPOINT,
    CLAIM_NODE,
    COMPUTE_REWARDS_ON_NODE,
    EVALUATE,
    INIT_POLICY,
    NODE_LIVENESS,
    RESTART_CELLS,
    ROLLOUT,
    TRAIN_STEP,
    UPDATE_WEIGHTS,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
EXCLUDED_NODE_ATTEMPTS = 4
CLAIM_HOLD_S = 30.0  # a claimed node is busy this long for other runs, or until the claiming run's watch starts
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


class NodeActivities:
    def __init__(self, runtime: NodeRuntime, report: Callable[[str, RunEvent], None] | None = None) -> None:
        self.rt = runtime
        self.report = report  # tells a run about an event outside any activity result (a signal)
        self.watching: Counter[str] = Counter()  # run id -> its node_liveness watches running here
        self.claimed: dict[str, float] = {}  # run id -> when it claimed this node (until its watch starts)
        self.on_run_left: Callable[[str], None] | None = None  # a run's watch ended here (workers.node_reclaim)

    # ---- fencing ------------------------------------------------------------------
    def _store(self, run_id: str, store_uri: str, epoch: int) -> FencedStore:
        """The run's store for this placement: writes only under the run's prefix and at its epoch."""
        return FencedStore(open_store(store_uri), run_id, epoch, self.rt.node_id)

    def _stale(self, run_id: str, epoch: int, message: str) -> ApplicationError:
        """A write of this node refused by the run's fence: the run has moved on (or moves now,
        when the refusal reaches a workflow that still waits). Reported to the run, then NodeLost."""
        event = RunEvent.now("stale_write_refused", f"node {self.rt.node_id} epoch {epoch}: {message}")
        log.warning("run %s: %s", run_id, event.detail)
        if self.report is not None:
            self.report(run_id, event)
        return failure(Failure.NODE_LOST, f"stale placement: {event.detail}", self.rt.task_queue)

    # ---- placement ----------------------------------------------------------------
    @activity.defn(name=CLAIM_NODE.name)
    def claim_node(self, inp: ClaimNodeInput) -> NodeClaim:
        # a node the run lost is left to others first; if it is the only one polling, it is
        # alive after all (it was slow, not gone), so it may take the run back
        if self.rt.task_queue in inp.exclude_queues and activity.info().attempt < EXCLUDED_NODE_ATTEMPTS:
            raise failure(Failure.NODE_EXCLUDED, f"{self.rt.task_queue} is excluded for {inp.run_id}")
        # one run per node: a node whose engines and trainer serve another live run (its
        # liveness watch runs here) is not free; the claim is retried, by a free node or later
        # (a claim holds the node for CLAIM_HOLD_S until the run's watch starts)
        now = time.monotonic()
        busy = sorted(({r for r, n in self.watching.items() if n}
                       | {r for r, t in self.claimed.items() if now - t < CLAIM_HOLD_S}) - {inp.run_id})
        if busy:
            raise failure(Failure.NODE_BUSY, f"{self.rt.node_id} ({self.rt.task_queue}) serves run {busy[0]}")
        self.claimed = {inp.run_id: now}
        self.rt.set_run(inp.run_id)
        epoch = next_epoch(open_store(inp.store_uri), inp.run_id) if inp.store_uri else 0
        return NodeClaim(node_id=self.rt.node_id, boot_id=self.rt.boot_id, task_queue=self.rt.task_queue, epoch=epoch)

    @activity.defn(name=NODE_LIVENESS.name)
    async def node_liveness(self, inp: NodeLivenessInput) -> None:
        """Heartbeat until the run cancels it. On the worker's event loop, not in the
        activity thread pool, so busy activities cannot delay it; a dead, stopped or
        partitioned agent stops heartbeating and the run moves (workflows/node_watch.py)."""
        self.watching[inp.run_id] += 1
        self.claimed.pop(inp.run_id, None)
        try:
            while True:
                activity.heartbeat()
                await asyncio.sleep(inp.interval_s)
        except asyncio.CancelledError:
            why = activity.cancellation_details()
            if why is not None and (why.not_found or why.timed_out):  # the run ended or moved on: not an error
                raise ApplicationError("liveness watch ended", type="WatchEnded",
                                       category=ApplicationErrorCategory.BENIGN) from None
            raise
        finally:  # the run ended or left this node
            self.watching[inp.run_id] -= 1
            self.claimed.pop(inp.run_id, None)
            if self.on_run_left is not None and not self.watching[inp.run_id]:
                self.on_run_left(inp.run_id)

    @activity.defn(name=INIT_POLICY.name)
    def init_policy(self, inp: InitPolicyInput) -> PolicyInfo:
        self.rt.set_run(inp.run_id)
        if inp.epoch:  # before anything this placement writes: older placements' writes are refused from here on
            try:
                raise_fence(open_store(inp.store_uri), inp.run_id, inp.epoch, self.rt.node_id, inp.policy_version + 1)
            except StaleEpoch as err:
                raise self._stale(inp.run_id, inp.epoch, str(err)) from err
        setup = self.rt.setups[inp.run_id] = translate.run_setup(inp, self.rt.node_id)
        info = self._trainer_call(inp.run_id, inp.epoch, INIT_POLICY.name,
                                  lambda: self.rt.trainer.ensure_version(setup, inp.policy_version))
        return translate.policy_info(info, self.rt.drain_events(), self.rt.node_id)

    # ---- the RL step --------------------------------------------------------------
    @activity.defn(name=ROLLOUT.name)
    def rollout(self, inp: RolloutInput) -> RolloutResult:
        fleet, tokenizer = self._engines()
        rows = self.rt.rows(inp.store_uri, inp.dataset.key)
        req = translate.rollout_request(inp, len(rows))
        deaths_before = self.rt.engine_deaths
        progress = {"chunks_done": 0, "chunks": 0}

        def chunk_done(done: int, total: int) -> None:
            progress.update(chunks_done=done, chunks=total)
            activity.heartbeat(dict(progress))

        def generate() -> RolloutStats:
            return run_rollout(req, RolloutContext(
                self._store(inp.run_id, inp.store_uri, inp.epoch), rows, tokenizer, fleet.generate_chunk,
                parallelism=max(1, len(fleet.slots)), on_chunk=chunk_done,
            ))

        # an agent chunk runs many turns and tool calls: heartbeat while it runs, not only per chunk
        # (every model turn and tool call is bounded: the engines' timeout, agent.tool_timeout_s)
        stats = self._generating(inp.run_id, inp.epoch, f"rollout step {inp.step}", (
            (lambda: with_heartbeat(generate, detail=lambda: dict(progress))) if req.rollout.agent is not None else generate
        ))
        metrics.ROLLOUT_TOKENS_PER_S.set(stats.tokens_per_s)
        metrics.RESPONSE_LENGTH.set(stats.response_len_mean)
        for name, value in (stats.agent or {}).items():
            metrics.AGENT.labels(name).set(value)
        metrics.PHASE_SECONDS.labels("rollout").observe(stats.seconds)
        self.rt.held.keep((inp.store_uri, inp.epoch), stats.chunks)  # scored next, on this node
        return RolloutResult(
            chunk_keys=stats.chunk_keys, n_samples=stats.n_samples, gen_tokens=stats.gen_tokens,
            response_len_mean=stats.response_len_mean, tokens_per_s=stats.tokens_per_s,
            chunks_reused=stats.chunks_reused,
            agent=stats.agent,
            engine_retries=self.rt.engine_deaths - deaths_before,
            seconds=stats.seconds,
            node_events=self.rt.drain_events(),
        )

    @activity.defn(name=COMPUTE_REWARDS_ON_NODE.name)
    def compute_rewards_on_node(self, inp: RewardInput) -> RewardResult:
        """Score a rollout's samples here, where the rollout left them in memory (the store is
        read only for chunks this agent does not hold), with the run's reward: the same
        scoring, stored rewards and judge records as ``activities.control.compute_rewards``."""
        t0 = time.perf_counter()
        where = (inp.store_uri, inp.epoch)
        store = open_store(inp.store_uri)
        samples, read = self.rt.held.samples(store, where, inp.chunk_keys)
        if read:
            log.info("rewards of step %d round %d: %d of %d chunks read from the store (not held here)",
                     inp.step, inp.round, read, len(inp.chunk_keys))
        rows = self.rt.rows(inp.store_uri, inp.dataset.key)
        result = rewards.score(inp, store, samples, rows, self.rt.node_id,
                               lambda err: self._stale(inp.run_id, inp.epoch, str(err)), t0)
        self.rt.held.release(where, inp.chunk_keys)
        return result

    @activity.defn(name=EVALUATE.name)
    def evaluate(self, inp: EvalInput) -> EvalResult:
        """Held-out greedy accuracy and pass@k of the version the engines serve."""
        fleet, tokenizer = self._engines()
        rows = self.rt.rows(inp.store_uri, inp.eval_key)
        progress = {"chunks_done": 0, "chunks": 0}
        stats = self._generating(inp.run_id, inp.epoch, f"evaluate step {inp.step}", lambda: with_heartbeat(
            lambda: run_eval(translate.eval_request(inp), RolloutContext(
                self._store(inp.run_id, inp.store_uri, inp.epoch), rows, tokenizer, fleet.generate_chunk,
                parallelism=max(1, len(fleet.slots)),
                on_chunk=lambda done, total: progress.update(chunks_done=done, chunks=total),
            )),
            detail=lambda: dict(progress),
        ))
        metrics.EVAL_GREEDY_ACCURACY.set(stats.greedy_accuracy)
        metrics.EVAL_PASS_AT_K.set(stats.pass_at_k)
        metrics.PHASE_SECONDS.labels("eval").observe(stats.seconds)
        return translate.eval_result(inp, stats, self.rt.drain_events())

    def _engines(self) -> tuple[EngineFleet, Tokenizer]:
        fleet, tokenizer = self.rt.fleet, self.rt.tokenizer
        if fleet is None or tokenizer is None:
            raise failure(Failure.NO_HEALTHY_ENGINE, "engines are not started on this node")
        with_heartbeat(self.rt.resume_engines)  # engines.release_memory: normally update_weights already did
        return fleet, tokenizer

    def _generating(self, run_id: str, epoch: int, what: str, fn: Callable[[], T]) -> T:
        """``fn()``, generating through the engines, with its failures mapped: no engine
        alive -> the slots are restarted with the served weights, then ``NoHealthyEngine``
        (Temporal retries; chunks already stored are reused); non-finite logprobs ->
        ``Divergence``; an answer from other weights -> ``StaleWeights``; a write the
        run's fence refuses -> reported, ``NodeLost``."""
        try:
            return fn()
        except StaleEpoch as err:
            raise self._stale(run_id, epoch, str(err)) from err
        except NoHealthyEngine as err:
            restarted = with_heartbeat(self.rt.recover_engines)
            raise failure(Failure.NO_HEALTHY_ENGINE, f"{what}: {err}; restarted slots {restarted}") from err
        except NonFiniteLogprobs as err:
            raise failure(Failure.DIVERGENCE, str(err)) from err
        except ToolNotFound as err:  # a rollout.agent tool or environment this node cannot import: not retried
            raise failure(Failure.INVALID_INPUT, f"{what}: {err}") from err
        except StaleWeights as err:
            raise failure(Failure.STALE_WEIGHTS, str(err)) from err

    @activity.defn(name=TRAIN_STEP.name)
    def train_step(self, inp: TrainStepInput) -> TrainStepResult:
        setup = self._setup(inp.run_id, inp.epoch)
        batch = translate.step_batch(inp)
        # engines.release_memory: the engines sleep while the trainer trains (update_weights wakes them)
        with_heartbeat(self.rt.release_engines)
        res = self._trainer_call(inp.run_id, inp.epoch, f"train_step {inp.step}",
                                 lambda: self.rt.trainer.train_step(setup, batch))
        bad = [k for k, v in res.metrics.items() if not math.isfinite(v)]
        if bad:
            raise failure(Failure.DIVERGENCE, f"step {inp.step}: non-finite {bad}")
        result = translate.train_step_result(res, self.rt.drain_events(), self.rt.node_id)
        metrics.record_train(result.metrics, result.seconds, len(result.replayed_steps))
        if inp.sampling is not None:  # dynamic sampling's counts (exported by assemble_batch before the selection)
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
        folder = self.rt.local_weights(inp.store_uri, inp.run_id, inp.policy_version, inp.weights_key, inp.checksum,
                                       export=self._exporter(inp.run_id, inp.policy_version))
        if e.backend == "sglang" and (why := unverifiable_reason(folder)) is not None:
            raise failure(Failure.INVALID_INPUT, f"engines.backend 'sglang': {why}")
        health = HealthConfig(
            interval_s=e.health_check_interval_s, timeout_s=e.health_check_timeout_s,
            first_wait_s=e.health_check_first_wait_s, failure_threshold=e.health_check_failure_threshold,
        )
        try:
            restarted = with_heartbeat(lambda: self.rt.ensure_engines(
                e.num_engines, health, folder, inp.policy_version, e.backend, host=e.host,
                weight_sync=e.weight_sync, weight_sync_timeout_s=e.weight_sync_timeout_s, run_id=inp.run_id,
                release_memory=e.release_memory, deterministic=e.deterministic, vllm_python=e.vllm_python))
        except WeightMismatch as err:
            raise failure(Failure.WEIGHT_MISMATCH, f"weight checksum mismatch: {err}") from err
        except NoHealthyEngine as err:
            raise failure(Failure.NO_HEALTHY_ENGINE, str(err)) from err
        assert self.rt.fleet is not None
        # an engine without a hash of its own (SGLang) reports the checksum of the folder whose
        # sampled parameters it was verified to hold (EngineFleet._probe_verified), else none
        checksums = {s.checksum for s in self.rt.fleet.snapshot() if s.state == "healthy"}
        if checksums != {inp.checksum}:
            raise failure(
                Failure.WEIGHT_MISMATCH,
                f"engines report checksums {sorted(c or '' for c in checksums)}, trainer {inp.checksum}",
            )
        snapshot = self.rt.fleet.snapshot()
        metrics.ENGINES_HEALTHY.set(sum(1 for s in snapshot if s.state == "healthy"))
        metrics.PHASE_SECONDS.labels("update_weights").observe(time.perf_counter() - t0)
        weights_bytes = (folder / "model.safetensors").stat().st_size
        metrics.WEIGHT_SYNC_BYTES.inc(weights_bytes * sum(1 for s in snapshot if s.state == "healthy"))
        return UpdateWeightsResult(
            policy_version=inp.policy_version,
            restarted_slots=restarted,
            engines=self.rt.fleet.snapshot(),
            seconds=time.perf_counter() - t0,
            node_events=self.rt.drain_events(),
        )

    def _exporter(self, run_id: str, version: int) -> Callable[[], None]:
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
        return setup.model_copy(update={"epoch": epoch, "offload_optimizer": self.rt.memory_phases.enabled})

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
                    error = self._stale(run_id, epoch, f"{what}: {err.message}")
                else:
                    error = disk_full_failure(err, self.rt.node_id, run_id, what, self.report) or _trainer_error(err, what)
                cause = err
        raise error from cause

    def live_runs(self) -> set[str]:
        """Runs this node serves now: watched, or claimed and not yet watched."""
        return {r for r, n in self.watching.items() if n} | set(self.claimed)

    def all(self) -> list[Callable]:
        """The activities of this node's own queue."""
        return [self.init_policy, self.rollout, self.compute_rewards_on_node, self.train_step, self.update_weights,
                self.checkpoint, self.evaluate, self.node_liveness, self.restart_cells]

    def pool(self) -> list[Callable]:
        """The activities of the shared pool queue: claiming this node for a run."""
        return [self.claim_node]


def _record_dp(dp: DPCells | None, events: list[RunEvent]) -> None:
    if dp is not None:
        metrics.record_dp(sum(c.state == "alive" for c in dp.cells), [e.kind for e in events])

