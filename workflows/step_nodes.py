"""A step's rollout nodes (``engines.nodes`` > 0): the run's engines on nodes other than its
trainer's. The step spreads each rollout's chunks over them, pushes each new version to
them and evaluates on one of them; a node lost during the step is dropped for the rest of
it and its unfinished chunks go to the survivors (``TrainingRun`` replaces it at the next
step boundary).

Loss is noticed by the work itself: every activity on a rollout node heartbeats and runs
with the run's liveness timeout as its heartbeat and schedule-to-start timeouts, so a
killed, stopped or partitioned node fails its work as ``NodeLost`` within a few seconds.

Which node generates which chunk is a function of the chunk numbers and the order of the
live nodes (``shares``), and a chunk's content of its seed and the policy version: a
retried, re-placed or replayed step trains the same samples whichever node made them.
Each node stores its chunks under keys of its own (``artifacts.rollout_chunk_key``): a
node the step dropped, writing late, never writes a key the step trains.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from spec.run import RunConfig
    from workflows.agent_metrics import pool_agent_metrics
    from workflows.contracts.sampling import RolloutInput, RolloutResult
    from workflows.failures import Failure, failure, failure_in
    from workflows.stubs import ROLLOUT, ActivityStub

T = TypeVar("T")
In = TypeVar("In")

# Temporal's name of a heartbeat timeout among a retry policy's non-retryable error types
HEARTBEAT_TIMEOUT = "TemporalTimeout:Heartbeat"


def chunk_count(cfg: RunConfig, n_prompts: int | None) -> int:
    """How many chunks a rollout of ``n_prompts`` prompts (None: ``prompts_per_step``) is cut into."""
    spec = cfg.rollout
    members = (spec.prompts_per_step if n_prompts is None else n_prompts) * spec.group_size
    return -(-members // spec.chunk_size)


def shares(chunks: list[int], queues: list[str]) -> dict[str, list[int]]:
    """``chunks`` dealt round-robin over ``queues`` (in their order): the i-th chunk to queue i mod n."""
    out: dict[str, list[int]] = {q: [] for q in queues}
    for i, c in enumerate(chunks):
        out[queues[i % len(queues)]].append(c)
    return {q: cs for q, cs in out.items() if cs}


class StepNodes:
    """The run's rollout nodes as one step sees them: the live ones, in order, and those it lost."""

    def __init__(self, queues: list[str], cfg: RunConfig) -> None:
        self.live = list(queues)
        self.lost: list[str] = []
        timeout = timedelta(seconds=cfg.node.liveness_timeout_s) if cfg.node.liveness_timeout_s > 0 else None
        self.timeout = timeout

    @property
    def spread(self) -> bool:
        """Whether the run has rollout nodes (else its engines are the trainer node's)."""
        return bool(self.live or self.lost)

    def stub(self, stub: ActivityStub) -> ActivityStub:
        """``stub`` with the liveness timeout as its heartbeat and schedule-to-start timeouts, and
        a heartbeat timeout final (the node is lost now): retried, each attempt would be taken
        by a long poll that a stopped (SIGSTOPped, partitioned) agent left open, and time out
        again, one attempt per open poll, for about a minute before the share is dealt again."""
        if self.timeout is None:
            return stub
        timed = stub.with_timeouts(heartbeat=self.timeout, schedule_to_start=self.timeout)
        final = [*(timed.retry.non_retryable_error_types or []), HEARTBEAT_TIMEOUT]
        return replace(timed, retry=replace(timed.retry, non_retryable_error_types=final))

    def drop(self, queue: str, why: str) -> None:
        if queue in self.live:
            self.live.remove(queue)
            self.lost.append(queue)
            workflow.logger.warning("rollout node %s lost during the step: %s", queue, why)

    def none_left(self, what: str) -> ApplicationError:
        return failure(Failure.ROLLOUT_NODES_LOST, f"{what}: every rollout node was lost ({', '.join(self.lost)})",
                       self.lost)

    async def on_each(self, work: dict[str, asyncio.Future[T]]) -> dict[str, T]:
        """Await work on several nodes; a node lost on the way is dropped and left out of the result."""
        out: dict[str, T] = {}
        for queue, fut in work.items():
            try:
                out[queue] = await fut
            except (ActivityError, ApplicationError) as err:
                kind, message = failure_in(err)
                if kind != Failure.NODE_LOST:
                    raise
                self.drop(queue, message)
        return out


async def rollout_spread(nodes: StepNodes, inp: RolloutInput, cfg: RunConfig, summary: str) -> RolloutResult:
    """One rollout (or dynamic-sampling round) spread over the live rollout nodes, each
    generating its share; a lost node's share is dealt again over the survivors."""
    total = chunk_count(cfg, inp.n_prompts)
    started = workflow.now()
    stub = nodes.stub(ROLLOUT)
    running: dict[asyncio.Task[RolloutResult], tuple[str, list[int]]] = {}

    def deal(chunks: list[int]) -> None:
        if not nodes.live:
            raise nodes.none_left(summary)
        for queue, mine in shares(chunks, nodes.live).items():
            task = asyncio.ensure_future(stub.run(
                inp.model_copy(update={"chunks": mine}), queue=queue,
                summary=f"{summary}: chunks {mine[0]}..{mine[-1]} ({len(mine)}) on {queue}",
            ))
            running[task] = (queue, mine)

    keys: dict[int, str] = {}
    parts: list[RolloutResult] = []
    try:
        deal(list(range(total)))
        while running:
            await workflow.wait(list(running), return_when=asyncio.FIRST_COMPLETED)
            for task in [t for t in running if t.done()]:
                queue, mine = running.pop(task)
                try:
                    part = task.result()
                except (ActivityError, ApplicationError) as err:
                    kind, message = failure_in(err)
                    if kind != Failure.NODE_LOST:
                        raise
                    nodes.drop(queue, message)
                    deal(mine)
                    continue
                parts.append(part)
                keys.update(zip(mine, part.chunk_keys))
    except BaseException:
        for task in running:
            task.cancel()
        raise
    return merged(parts, [keys[c] for c in range(total)], (workflow.now() - started).total_seconds())


def merged(parts: list[RolloutResult], chunk_keys: list[str], seconds: float) -> RolloutResult:
    """The shares of one rollout as one result, its chunks in chunk order."""
    n_samples = sum(p.n_samples for p in parts)
    gen_tokens = sum(p.gen_tokens for p in parts)
    return RolloutResult(
        chunk_keys=chunk_keys, n_samples=n_samples, gen_tokens=gen_tokens,
        response_len_mean=gen_tokens / max(1, n_samples), tokens_per_s=gen_tokens / max(seconds, 1e-9),
        chunks_reused=sum(p.chunks_reused for p in parts), engine_retries=sum(p.engine_retries for p in parts),
        seconds=seconds, node_events=[e for p in parts for e in p.node_events],
        agent=pool_agent_metrics([p.agent for p in parts if p.agent]),
    )
