"""Rollout of one RL step: fixed chunks, generated through the node's engines,
stored under deterministic keys (a retried chunk whose artifact exists is reused).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_runtime.agent.metrics import episode_metrics
from gpu_runtime.agent.settings import AgentSettings
from gpu_runtime.store import artifacts as art
from gpu_runtime.data.datasets import encode_prompt, prompts_for_step
from gpu_runtime.store.object_store import ObjectStore
from gpu_runtime.models.tokenizer import Tokenizer

if TYPE_CHECKING:
    from gpu_runtime.agent.episodes import AgentCounters

log = logging.getLogger(__name__)

# (batch of input ids, sampling params) -> (one SGLang-shaped result per prompt, engine url)
ChunkGenerator = Callable[[list[list[int]], dict], tuple[list[dict], str]]


class NonFiniteLogprobs(RuntimeError):
    """The policy produced NaN/inf: the run has diverged (not retryable)."""


class StaleWeights(RuntimeError):
    """An engine answered with weights other than the step's policy version."""


@dataclass(frozen=True)
class ChunkPlan:
    chunk: int
    seed: int
    members: list[tuple[int, int]]  # (dataset index, group index)


@dataclass(frozen=True)
class RolloutRequest:
    run_id: str
    step: int
    seed: int
    policy_version: int
    data_cursor: int
    n_rows: int
    prompts_per_step: int
    group_size: int
    chunk_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    round: int = 0  # dynamic sampling: the step's round (0: the first, or no filter)
    stop: list[str] = field(default_factory=list)  # SGLang's sampling params: stop strings
    stop_token_ids: list[int] = field(default_factory=list)  # and stop tokens besides EOS
    agent: AgentSettings | None = None  # multi-turn tool-calling episodes (gpu_runtime.agent)


@dataclass
class RolloutStats:
    chunk_keys: list[str]
    n_samples: int
    gen_tokens: int
    response_len_mean: float
    tokens_per_s: float
    chunks_reused: int
    seconds: float
    agent: dict[str, float] | None = None  # episode metrics (gpu_runtime.agent.metrics), agent rollouts only


def plan_chunks(req: RolloutRequest) -> list[ChunkPlan]:
    """The step's samples, in a fixed order, cut into fixed chunks (DESIGN §5-6)."""
    indices = prompts_for_step(req.n_rows, req.seed, req.data_cursor, req.prompts_per_step)
    return cut_chunks([(idx, g) for idx in indices for g in range(req.group_size)], req)


def cut_chunks(members: list[tuple[int, int]], req: RolloutRequest) -> list[ChunkPlan]:
    """``members`` in order, ``req.chunk_size`` per chunk; chunk ``c`` samples with seed
    ``derive_seed(req.seed, req.step, c)`` (round ``r`` > 0 of dynamic sampling:
    ``derive_seed(req.seed, req.step, "round", r, c)``)."""
    return [
        ChunkPlan(
            chunk=c,
            seed=(art.derive_seed(req.seed, req.step, "round", req.round, c) if req.round
                  else art.derive_seed(req.seed, req.step, c)),
            members=members[start : start + req.chunk_size],
        )
        for c, start in enumerate(range(0, len(members), req.chunk_size))
    ]


def generate_chunk(
    req: RolloutRequest, plan: ChunkPlan, rows: list[dict], tokenizer: Tokenizer, generate: ChunkGenerator
) -> art.RolloutChunk:
    prompts = [encode_prompt(tokenizer, rows[idx]) for idx, _ in plan.members]
    params = {
        "max_new_tokens": req.max_new_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "sampling_seed": plan.seed,
    }
    if req.stop:  # SGLang's names; left out when unset, so such requests stay as they were
        params["stop"] = list(req.stop)
    if req.stop_token_ids:
        params["stop_token_ids"] = list(req.stop_token_ids)
    results, url = generate_checked(req, plan, prompts, params, generate)
    samples = []
    for (idx, g), prompt_ids, (ids, lps, finish) in zip(plan.members, prompts, results, strict=True):
        samples.append(
            art.Sample(
                sample_id=sample_id(req, idx, g),
                prompt_index=idx,
                group_index=g,
                prompt_ids=prompt_ids,
                response_ids=ids,
                logprobs=lps,
                weight_version=req.policy_version,
                finish_reason=finish,
                prompt_text=tokenizer.decode(prompt_ids, skip_special=False),
                response_text=tokenizer.decode(ids),
            )
        )
    return art.RolloutChunk(
        run_id=req.run_id, step=req.step, chunk=plan.chunk, seed=plan.seed,
        weight_version=req.policy_version, engine_url=url, samples=samples,
    )


def sample_id(req: RolloutRequest, idx: int, g: int) -> str:
    return f"s{req.step}-r{req.round}-p{idx}-g{g}" if req.round else f"s{req.step}-p{idx}-g{g}"


Generated = tuple[list[int], list[float], str]  # (output ids, their logprobs, finish reason)


def generate_checked(
    req: RolloutRequest, plan: ChunkPlan, prompts: list[list[int]], params: dict, generate: ChunkGenerator
) -> tuple[list[Generated], str]:
    """One batch through the engines, each result checked: served by the step's policy
    version (else ``StaleWeights``) with finite logprobs (else ``NonFiniteLogprobs``)."""
    results, url = generate(prompts, params)
    if len(results) != len(prompts):
        raise RuntimeError(f"engine {url} returned {len(results)} results for {len(prompts)} prompts")
    out: list[Generated] = []
    for res in results:
        meta = res.get("meta_info", {})
        version = meta.get("weight_version")
        if version is not None and int(version) != req.policy_version:
            raise StaleWeights(f"engine {url} serves v{version}, step {req.step} needs v{req.policy_version}")
        lps = [float(t[0]) for t in meta.get("output_token_logprobs", [])]
        if not all(math.isfinite(x) for x in lps):
            raise NonFiniteLogprobs(f"step {req.step} chunk {plan.chunk}: policy v{req.policy_version} logprobs are not finite")
        finish = meta.get("finish_reason") or {}
        out.append((list(res["output_ids"]), lps, finish.get("type", "stop") if isinstance(finish, dict) else str(finish)))
    return out, url


def run_rollout(
    req: RolloutRequest,
    store: ObjectStore,
    rows: list[dict],
    tokenizer: Tokenizer,
    generate: ChunkGenerator,
    *,
    parallelism: int,
    on_chunk: Callable[[int, int], None] | None = None,
) -> RolloutStats:
    """Generate every missing chunk (``parallelism`` in flight) and store it."""
    t0 = time.perf_counter()
    plans = plan_chunks(req)
    keys = [art.rollout_chunk_key(req.run_id, req.step, p.chunk, req.round) for p in plans]
    from gpu_runtime.agent.episodes import AgentCounters  # the agent imports this module

    counters = AgentCounters() if req.agent is not None else None
    reused = generate_chunks(
        req, list(zip(plans, keys)), store, rows, tokenizer, generate, parallelism=parallelism, on_chunk=on_chunk,
        agent_counters=counters,
    )
    n_tokens, n_samples = 0, 0
    samples: list[art.Sample] = []
    for key in keys:
        chunk = art.get_model(store, key, art.RolloutChunk)
        n_samples += len(chunk.samples)
        n_tokens += sum(len(s.response_ids) for s in chunk.samples)
        samples += chunk.samples if counters is not None else []
    agent = None
    if counters is not None:
        agent = episode_metrics(samples) | {
            "turns_reused": float(counters.turns_reused), "model_turns_reused": float(counters.model_turns_reused),
            "tools_run": float(counters.tools_run),
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
    )


def generate_chunks(
    req: RolloutRequest,
    planned: list[tuple[ChunkPlan, str]],
    store: ObjectStore,
    rows: list[dict],
    tokenizer: Tokenizer,
    generate: ChunkGenerator,
    *,
    parallelism: int,
    on_chunk: Callable[[int, int], None] | None = None,
    agent_counters: "AgentCounters | None" = None,
) -> int:
    """Generate and store each (plan, key) whose key is not in the store yet,
    ``parallelism`` in flight; the number of chunks found there (reused)."""
    todo = [(p, k) for p, k in planned if not store.exists(k)]
    done = reused = len(planned) - len(todo)

    def work(item: tuple[ChunkPlan, str]) -> None:
        plan, key = item
        if req.agent is not None:
            from gpu_runtime.agent.episodes import generate_agent_chunk  # the agent imports this module

            chunk = generate_agent_chunk(req, plan, rows, tokenizer, generate, store, agent_counters)
        else:
            chunk = generate_chunk(req, plan, rows, tokenizer, generate)
        art.put_model(store, key, chunk)

    with ThreadPoolExecutor(max_workers=max(1, parallelism)) as pool:
        for _ in pool.map(work, todo):
            done += 1
            if on_chunk:
                on_chunk(done, len(planned))
    return reused
