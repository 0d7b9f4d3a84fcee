"""Stateful activities served by a node agent on ``node-<node_id>-<boot_id>``.

Thin adapters: validate, call ``gpu_runtime``, heartbeat, map failures to
retryable / non-retryable errors.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone

from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.heartbeat import with_heartbeat
from gpu_runtime.node import metrics
from gpu_runtime.engine.backends import SGLangEngineBackend
from gpu_runtime.engine.fleet import HealthConfig, NoHealthyEngine, WeightMismatch
from gpu_runtime.node.runtime import NodeRuntime
from gpu_runtime.engine.rollout import NonFiniteLogprobs, RolloutRequest, StaleWeights, run_rollout
from gpu_runtime.node.rpc import RemoteError
from gpu_runtime.store.uri import open_store
from gpu_runtime.models.tokenizer import CharTokenizer
from gpu_runtime.trainer.process import TrainerDied
from workflows.contracts import (
    CheckpointInput,
    CheckpointResult,
    ClaimNodeInput,
    EngineSlotInfo,
    InitPolicyInput,
    NodeClaim,
    PolicyInfo,
    RolloutInput,
    RolloutResult,
    RunEvent,
    TrainStepInput,
    TrainStepResult,
    UpdateWeightsInput,
    UpdateWeightsResult,
)

log = logging.getLogger(__name__)
EXCLUDED_NODE_ATTEMPTS = 4
NON_RETRYABLE_REMOTE = {"ValueError": "InvalidInput", "Divergence": "Divergence"}


def _trainer_error(err: Exception, what: str) -> ApplicationError:
    if isinstance(err, RemoteError) and err.error_type in NON_RETRYABLE_REMOTE:
        return ApplicationError(f"{what}: {err.message}", type=NON_RETRYABLE_REMOTE[err.error_type], non_retryable=True)
    if isinstance(err, TrainerDied):
        return ApplicationError(f"{what}: {err}", type="TrainerDied")
    return ApplicationError(f"{what}: {err}", type=type(err).__name__)


class NodeActivities:
    def __init__(self, runtime: NodeRuntime) -> None:
        self.rt = runtime
        self.tokenizer = CharTokenizer()

    # ---- placement ----------------------------------------------------------------
    @activity.defn(name="claim_node")
    def claim_node(self, inp: ClaimNodeInput) -> NodeClaim:
        # a node the run lost is left to others first; if it is the only one polling, it is
        # alive after all (it was slow, not gone), so it may take the run back
        if self.rt.task_queue in inp.exclude_queues and activity.info().attempt < EXCLUDED_NODE_ATTEMPTS:
            raise ApplicationError(f"{self.rt.task_queue} is excluded for {inp.run_id}", type="NodeExcluded")
        self.rt.set_run(inp.run_id)
        return NodeClaim(node_id=self.rt.node_id, boot_id=self.rt.boot_id, task_queue=self.rt.task_queue)

    @activity.defn(name="init_policy")
    def init_policy(self, inp: InitPolicyInput) -> PolicyInfo:
        self.rt.set_run(inp.run_id)
        setup = {
            "run_id": inp.run_id,
            "store_uri": inp.store_uri,
            "seed": inp.seed,
            "model": inp.model.model_dump(),
            "sft_steps": inp.sft.steps,
            "sft_batch_size": inp.sft.batch_size,
            "sft_lr": inp.sft.lr,
            "dataset_key": inp.dataset.key,
            "hparams": _hparams(inp.train.model_dump()),
            "keep_last": inp.checkpoint.keep_last,
            "config_hash": inp.config_hash,
        }
        self.rt.setups[inp.run_id] = setup
        try:
            info = with_heartbeat(lambda: self.rt.trainer.call("ensure_version", {"setup": setup, "target": inp.policy_version}))
        except Exception as err:
            raise _trainer_error(err, "init_policy") from err
        return PolicyInfo(
            policy_version=info["policy_version"], checksum=info["checksum"], weights_key=info["weights_key"],
            sft_metrics=info["sft_metrics"], seconds=info["seconds"], restored_from_step=info["restored_from_step"],
            node_events=_store_events(info.get("events", [])),
        )

    # ---- the RL step --------------------------------------------------------------
    @activity.defn(name="rollout")
    def rollout(self, inp: RolloutInput) -> RolloutResult:
        fleet = self.rt.fleet
        if fleet is None:
            raise ApplicationError("engines are not started on this node", type="NoHealthyEngine")
        rows = self.rt.rows(inp.store_uri, inp.dataset.key)
        r = inp.rollout
        req = RolloutRequest(
            run_id=inp.run_id, step=inp.step, seed=inp.seed, policy_version=inp.policy_version,
            data_cursor=inp.data_cursor, n_rows=len(rows), prompts_per_step=r.prompts_per_step,
            group_size=r.group_size, chunk_size=r.chunk_size, max_new_tokens=r.max_new_tokens,
            temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        )
        deaths_before = self.rt.engine_deaths
        try:
            stats = run_rollout(
                req, open_store(inp.store_uri), rows, self.tokenizer, fleet.generate_chunk,
                parallelism=max(1, len(fleet.slots)),
                on_chunk=lambda done, total: activity.heartbeat({"chunks_done": done, "chunks": total}),
            )
        except NoHealthyEngine as err:
            # nothing can generate: bring the slots back with the step's weights, then let
            # Temporal retry the activity (chunks already stored are reused)
            restarted = with_heartbeat(self.rt.recover_engines)
            raise ApplicationError(
                f"rollout step {inp.step}: {err}; restarted slots {restarted}", type="NoHealthyEngine"
            ) from err
        except NonFiniteLogprobs as err:
            raise ApplicationError(str(err), type="Divergence", non_retryable=True) from err
        except StaleWeights as err:
            raise ApplicationError(str(err), type="StaleWeights") from err
        metrics.ROLLOUT_TOKENS_PER_S.set(stats.tokens_per_s)
        metrics.RESPONSE_LENGTH.set(stats.response_len_mean)
        metrics.PHASE_SECONDS.labels("rollout").observe(stats.seconds)
        return RolloutResult(
            chunk_keys=stats.chunk_keys, n_samples=stats.n_samples, gen_tokens=stats.gen_tokens,
            response_len_mean=stats.response_len_mean, tokens_per_s=stats.tokens_per_s,
            chunks_reused=stats.chunks_reused,
            engine_retries=self.rt.engine_deaths - deaths_before,
            seconds=stats.seconds,
            node_events=self._events(),
        )

    @activity.defn(name="train_step")
    def train_step(self, inp: TrainStepInput) -> TrainStepResult:
        setup = self._setup(inp.run_id)
        spec = {
            "step": inp.step, "policy_version": inp.policy_version, "chunk_keys": inp.chunk_keys,
            "rewards_key": inp.rewards_key, "group_size": inp.group_size,
            "hparams": _hparams({**setup["hparams"], **inp.train.model_dump()}),
        }
        try:
            res = with_heartbeat(lambda: self.rt.trainer.call("train_step", {"setup": setup, "spec": spec}))
        except Exception as err:
            raise _trainer_error(err, f"train_step {inp.step}") from err
        values = res["metrics"]
        bad = [k for k, v in values.items() if v != v or v in (float("inf"), float("-inf"))]
        if bad:
            raise ApplicationError(f"step {inp.step}: non-finite {bad}", type="Divergence", non_retryable=True)
        result = TrainStepResult(**{**res, "node_events": _store_events(res.pop("events", []))})
        metrics.record_train(result.metrics, result.seconds, len(result.replayed_steps))
        metrics.POLICY_VERSION.set(result.policy_version)
        return result

    @activity.defn(name="update_weights")
    def update_weights(self, inp: UpdateWeightsInput) -> UpdateWeightsResult:
        t0 = time.perf_counter()
        e = inp.engines
        if e.backend == "sglang" and not SGLangEngineBackend.available():
            raise ApplicationError(
                "engines.backend 'sglang': sglang is not installed on this node (pip install '.[gpu]' on a CUDA node)",
                type="InvalidInput", non_retryable=True,
            )
        folder = self.rt.local_weights(inp.store_uri, inp.run_id, inp.policy_version, inp.weights_key)
        health = HealthConfig(
            interval_s=e.health_check_interval_s, timeout_s=e.health_check_timeout_s,
            first_wait_s=e.health_check_first_wait_s or 120.0, failure_threshold=e.health_check_failure_threshold,
        )
        try:
            restarted = with_heartbeat(lambda: self.rt.ensure_engines(e.num_engines, health, folder, inp.policy_version, e.backend))
        except WeightMismatch as err:
            raise ApplicationError(f"weight checksum mismatch: {err}", type="WeightMismatch") from err
        except NoHealthyEngine as err:
            raise ApplicationError(str(err), type="NoHealthyEngine") from err
        assert self.rt.fleet is not None
        checksums = {s.checksum for s in self.rt.fleet.snapshot() if s.state == "healthy"}
        if checksums != {inp.checksum}:
            raise ApplicationError(
                f"engines report checksums {sorted(c or '' for c in checksums)}, trainer {inp.checksum}",
                type="WeightMismatch",
            )
        snapshot = self.rt.fleet.snapshot()
        metrics.ENGINES_HEALTHY.set(sum(1 for s in snapshot if s.state == "healthy"))
        metrics.PHASE_SECONDS.labels("update_weights").observe(time.perf_counter() - t0)
        weights_bytes = (folder / "model.safetensors").stat().st_size
        metrics.WEIGHT_SYNC_BYTES.inc(weights_bytes * sum(1 for s in snapshot if s.state == "healthy"))
        return UpdateWeightsResult(
            policy_version=inp.policy_version,
            restarted_slots=restarted,
            engines=[EngineSlotInfo(**s.model_dump(exclude={"weight_version"}), weight_version=_int(s.weight_version))
                     for s in self.rt.fleet.snapshot()],
            seconds=time.perf_counter() - t0,
            node_events=self._events(),
        )

    @activity.defn(name="checkpoint")
    def checkpoint(self, inp: CheckpointInput) -> CheckpointResult:
        t0 = time.perf_counter()
        setup = self._setup(inp.run_id)
        try:
            res = with_heartbeat(
                lambda: self.rt.trainer.call(
                    "checkpoint", {"setup": setup, "step": inp.step, "data_cursor": inp.data_cursor, "sync": False}
                )
            )
        except Exception as err:
            raise _trainer_error(err, f"checkpoint {inp.step}") from err
        seconds = time.perf_counter() - t0
        metrics.PHASE_SECONDS.labels("checkpoint").observe(seconds)
        return CheckpointResult(step=inp.step, key=res["key"], seconds=seconds, durable=res["durable"])

    def _events(self) -> list[RunEvent]:
        return [
            RunEvent(
                at=datetime.fromtimestamp(float(e.get("at", 0)), timezone.utc).isoformat(),
                kind=e["kind"],
                detail=f"slot {e.get('slot')}: {e.get('detail', '')}",
            )
            for e in self.rt.drain_events()
        ]

    def _setup(self, run_id: str) -> dict:
        setup = self.rt.setups.get(run_id)
        if setup is None:  # this process never ran init_policy for the run: re-place
            raise ApplicationError(f"node has no setup for run {run_id}", type="NodeLost", non_retryable=True)
        return setup

    def all(self) -> list:
        return [self.init_policy, self.rollout, self.train_step, self.update_weights, self.checkpoint]


def _store_events(events: list[dict]) -> list[RunEvent]:
    now = datetime.now(timezone.utc).isoformat()
    return [
        RunEvent(at=now, kind=str(e.get("kind", "checkpoint_event")),
                 detail=", ".join(f"{k}={v}" for k, v in e.items() if k != "kind"))
        for e in events
    ]


def _hparams(train: dict) -> dict:
    return {k: v for k, v in train.items() if k in TRAIN_TO_TRAINER}


TRAIN_TO_TRAINER = {
    "lr", "clip_eps", "kl_coef", "grad_clip", "weight_decay", "ppo_epochs",
}


def _int(v: object) -> int | None:
    try:
        return int(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
