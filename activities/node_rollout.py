"""Generating through the run's engines on this node: rollouts, their rewards scored where
the samples are held, and held-out evaluation."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TypeVar

from temporalio import activity

from activities import rewards, translate
from activities.fence import RunFence
from activities.heartbeat import with_heartbeat
from gpu_runtime.engine.fleet import EngineFleet
from gpu_runtime.engine.fleet_types import NoHealthyEngine
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.node.runtime import NodeRuntime
from gpu_runtime.proc import metrics
from gpu_runtime.rollout.agent.tools import ToolNotFound
from gpu_runtime.rollout.chunks import NonFiniteLogprobs, RolloutContext, StaleWeights
from gpu_runtime.rollout.dispatch import RolloutStats, run_rollout
from gpu_runtime.rollout.evaluate import run_eval
from gpu_runtime.store.fence import StaleEpoch
from gpu_runtime.store.uri import open_store
from workflows.contracts.sampling import RewardInput, RewardResult, RolloutInput, RolloutResult
from workflows.contracts.training import EvalInput, EvalResult
from workflows.failures import Failure, failure
from workflows.stubs import COMPUTE_REWARDS_ON_NODE, EVALUATE, ROLLOUT

log = logging.getLogger(__name__)
T = TypeVar("T")


class RolloutActivities:
    def __init__(self, runtime: NodeRuntime, fence: RunFence) -> None:
        self.rt = runtime
        self.fence = fence

    @activity.defn(name=ROLLOUT.name)
    def rollout(self, inp: RolloutInput) -> RolloutResult:
        fleet, tokenizer = self._engines()
        rows = self.rt.datasets.rows(inp.store_uri, inp.dataset.key)
        req = translate.rollout_request(inp, len(rows), self.rt.node_id)
        deaths_before = self.rt.engines.engine_deaths
        progress = {"chunks_done": 0, "chunks": 0}

        def chunk_done(done: int, total: int) -> None:
            progress.update(chunks_done=done, chunks=total)
            activity.heartbeat(dict(progress))

        def generate() -> RolloutStats:
            return run_rollout(req, RolloutContext(
                self.fence.store(inp.run_id, inp.store_uri, inp.epoch), rows, tokenizer, fleet.generate_chunk,
                parallelism=max(1, len(fleet.slots)), on_chunk=chunk_done,
                pin=lambda key: functools.partial(fleet.generate_chunk, affinity=key),
            ))

        # heartbeat while it runs, not only per chunk: a chunk (an agent chunk's turns and tool calls, or
        # one slow batch on a loaded machine) may outlast the heartbeat timeout, which on a rollout node
        # is the run's liveness timeout (3 s); a stopped or dead agent stops this beat too
        stats = self._generating(inp.run_id, inp.epoch, f"rollout step {inp.step}",
                                 lambda: with_heartbeat(generate, detail=lambda: dict(progress)))
        metrics.ROLLOUT_TOKENS_PER_S.set(stats.tokens_per_s)
        metrics.RESPONSE_LENGTH.set(stats.response_len_mean)
        for name, value in (stats.agent or {}).items():
            metrics.AGENT.labels(name).set(value)
        metrics.PHASE_SECONDS.labels("rollout").observe(stats.seconds)
        if inp.chunks is None:  # the whole rollout: scored next, on this node (a share is scored on the trainer's)
            self.rt.held.keep((inp.store_uri, inp.epoch), stats.chunks)
        return RolloutResult(
            chunk_keys=stats.chunk_keys, n_samples=stats.n_samples, gen_tokens=stats.gen_tokens,
            response_len_mean=stats.response_len_mean, tokens_per_s=stats.tokens_per_s,
            chunks_reused=stats.chunks_reused,
            agent=stats.agent,
            engine_retries=self.rt.engines.engine_deaths - deaths_before,
            seconds=stats.seconds,
            node_events=self.rt.drain_events(),
        )

    @activity.defn(name=COMPUTE_REWARDS_ON_NODE.name)
    def compute_rewards_on_node(self, inp: RewardInput) -> RewardResult:
        """Score a rollout's samples here, where the rollout left them in memory (the store is
        read only for chunks this agent does not hold), with the run's reward; the rewards and
        a judge's records are written at the step's placement epoch."""
        t0 = time.perf_counter()
        where = (inp.store_uri, inp.epoch)
        store = open_store(inp.store_uri)
        samples, read = self.rt.held.samples(store, where, inp.chunk_keys)
        if read:
            log.info("rewards of step %d round %d: %d of %d chunks read from the store (not held here)",
                     inp.step, inp.round, read, len(inp.chunk_keys))
        rows = self.rt.datasets.rows(inp.store_uri, inp.dataset.key)
        try:
            result = rewards.score(inp, self.fence.over(store, inp.run_id, inp.epoch), samples, rows, t0)
        except StaleEpoch as err:  # a judge record or the rewards refused: the run has moved on
            raise self.fence.stale(inp.run_id, inp.epoch, str(err)) from err
        self.rt.held.release(where, inp.chunk_keys)
        return result

    @activity.defn(name=EVALUATE.name)
    def evaluate(self, inp: EvalInput) -> EvalResult:
        """Held-out greedy accuracy and pass@k of the version the engines serve."""
        fleet, tokenizer = self._engines()
        rows = self.rt.datasets.rows(inp.store_uri, inp.eval_key)
        progress = {"chunks_done": 0, "chunks": 0}
        stats = self._generating(inp.run_id, inp.epoch, f"evaluate step {inp.step}", lambda: with_heartbeat(
            lambda: run_eval(translate.eval_request(inp), RolloutContext(
                self.fence.store(inp.run_id, inp.store_uri, inp.epoch), rows, tokenizer, fleet.generate_chunk,
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
        fleet, tokenizer = self.rt.engines.fleet, self.rt.engines.tokenizer
        if fleet is None or tokenizer is None:
            raise failure(Failure.NO_HEALTHY_ENGINE, "engines are not started on this node")
        with_heartbeat(self.rt.engines.resume)  # engines.release_memory: normally update_weights already did
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
            raise self.fence.stale(run_id, epoch, str(err)) from err
        except NoHealthyEngine as err:
            restarted = with_heartbeat(self.rt.recover_engines)
            raise failure(Failure.NO_HEALTHY_ENGINE, f"{what}: {err}; restarted slots {restarted}") from err
        except NonFiniteLogprobs as err:
            raise failure(Failure.DIVERGENCE, str(err)) from err
        except ToolNotFound as err:  # a rollout.agent tool or environment this node cannot import: not retried
            raise failure(Failure.INVALID_INPUT, f"{what}: {err}") from err
        except StaleWeights as err:
            raise failure(Failure.STALE_WEIGHTS, str(err)) from err
