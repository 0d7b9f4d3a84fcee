"""The dispatcher of a step's rollout: the step's chunks sent to the node's engines as
capacity frees up (``parallelism`` in flight), each stored under its deterministic key; a
retried rollout reuses every chunk it finds in the store (idempotent). The rollout returns
its chunks as well, so the node agent scores them from memory (``gpu_runtime.rollout.held``).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from gpu_runtime.rollout.agent.episodes import AgentCounters, generate_agent_chunk
from gpu_runtime.rollout.agent.agent_process import ZYGOTES, AgentZygote
from gpu_runtime.rollout.agent.metrics import episode_metrics
from gpu_runtime.rollout.agent.openai_chunk import OpenAICounters, generate_openai_chunk
from gpu_runtime.rollout.chunks import ChunkPlan, RolloutContext, plan_chunks
from gpu_runtime.rollout.request import RolloutRequest
from gpu_runtime.rollout.single_turn import generate_chunk
from gpu_runtime.store import artifacts as art


@dataclass
class RolloutStats:
    chunk_keys: list[str]
    n_samples: int
    gen_tokens: int
    response_len_mean: float
    tokens_per_s: float
    chunks_reused: int
    seconds: float
    agent: dict[str, float] | None = None  # episode metrics (gpu_runtime.rollout.agent.metrics), agent rollouts only
    chunks: dict[str, art.RolloutChunk] = field(default_factory=dict, repr=False)  # by key, as stored


def run_rollout(req: RolloutRequest, ctx: RolloutContext) -> RolloutStats:
    """Generate every missing chunk (``ctx.parallelism`` in flight) and store it."""
    t0 = time.perf_counter()
    plans = plan_chunks(req)
    if req.chunks is not None:  # this node's share of a rollout spread over rollout nodes
        plans = [p for p in plans if p.chunk in req.chunks]
    own = req.node if req.chunks is not None else ""
    keys = [art.rollout_chunk_key(req.run_id, req.step, p.chunk, req.round, own) for p in plans]
    agent_kind = req.rollout.agent.kind if req.rollout.agent is not None else None
    counters = AgentCounters() if agent_kind in ("tools", "environment") else None
    openai = OpenAICounters() if agent_kind == "openai" else None
    zygote = None  # kind openai: the node's zygote for the run's agent (its module imported once per node)
    if openai is not None and req.rollout.agent is not None and req.rollout.agent.entrypoint is not None:
        zygote = ZYGOTES.get(req.run_id, req.rollout.agent.entrypoint)
    chunks, reused = generate_chunks(req, list(zip(plans, keys)), ctx, agent_counters=counters,
                                     openai_counters=openai, zygote=zygote)
    n_tokens, n_samples = 0, 0
    samples: list[art.Sample] = []
    for chunk in chunks:
        n_samples += len(chunk.samples)
        n_tokens += sum(len(s.response_ids) for s in chunk.samples)
        samples += chunk.samples if agent_kind is not None else []
    agent = None
    if counters is not None:
        agent = episode_metrics(samples) | {
            "turns_reused": float(counters.turns_reused), "model_turns_reused": float(counters.model_turns_reused),
            "tools_run": float(counters.tools_run),
        }
    if openai is not None:
        agent = episode_metrics(samples) | {
            "calls_generated": float(openai.generated), "calls_replayed": float(openai.replayed),
            "replay_diverged": float(openai.diverged), "episodes_reused": float(openai.episodes_reused),
            "agent_restarts": float(openai.agent_restarts),
            "agent_seconds_mean": sum(openai.agent_seconds) / max(1, len(openai.agent_seconds)),
        }
    seconds = time.perf_counter() - t0
    return RolloutStats(
        chunk_keys=keys,
        n_samples=n_samples,
        gen_tokens=n_tokens,
        response_len_mean=n_tokens / max(1, n_samples),
        tokens_per_s=n_tokens / max(seconds, 1e-9),
        chunks_reused=reused,
        seconds=seconds,
        agent=agent,
        chunks=dict(zip(keys, chunks)),
    )


def generate_chunks(
    req: RolloutRequest, planned: list[tuple[ChunkPlan, str]], ctx: RolloutContext,
    agent_counters: AgentCounters | None = None, openai_counters: OpenAICounters | None = None,
    zygote: AgentZygote | None = None,
) -> tuple[list[art.RolloutChunk], int]:
    """Generate and store each (plan, key) whose key is not in the store yet,
    ``ctx.parallelism`` in flight. Returns every planned chunk, in order (the ones found in
    the store read from it, the others as stored), and the number found there (reused)."""
    found = {k: art.get_model(ctx.store, k, art.RolloutChunk) for _, k in planned if ctx.store.exists(k)}
    todo = [(p, k) for p, k in planned if k not in found]
    done = reused = len(found)

    def work(item: tuple[ChunkPlan, str]) -> tuple[str, art.RolloutChunk]:
        plan, key = item
        if req.rollout.agent is not None and req.rollout.agent.kind == "openai":
            chunk = generate_openai_chunk(req, plan, ctx.rows, ctx.tokenizer, ctx.generate, ctx.store,
                                          openai_counters, ctx.pin, zygote)
        elif req.rollout.agent is not None:
            chunk = generate_agent_chunk(req, plan, ctx.rows, ctx.tokenizer, ctx.generate, ctx.store, agent_counters)
        else:
            chunk = generate_chunk(req, plan, ctx.rows, ctx.tokenizer, ctx.generate)
        if req.node:
            chunk = chunk.model_copy(update={"node": req.node})
        art.put_model(ctx.store, key, chunk)
        return key, chunk

    with ThreadPoolExecutor(max_workers=max(1, ctx.parallelism)) as pool:
        for key, chunk in pool.map(work, todo):
            found[key] = chunk
            done += 1
            if ctx.on_chunk:
                ctx.on_chunk(done, len(planned))
    return [found[k] for _, k in planned], reused
