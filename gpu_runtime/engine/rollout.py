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

from gpu_runtime.store import artifacts as art
from gpu_runtime.data.datasets import encode_prompt, prompts_for_step
from gpu_runtime.store.object_store import ObjectStore
from gpu_runtime.models.tokenizer import Tokenizer

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


@dataclass
class RolloutStats:
    chunk_keys: list[str]
    n_samples: int
    gen_tokens: int
    response_len_mean: float
    tokens_per_s: float
    chunks_reused: int
    seconds: float


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
    results, url = generate(prompts, params)
    if len(results) != len(prompts):
        raise RuntimeError(f"engine {url} returned {len(results)} results for {len(prompts)} prompts")
    samples = []
    for (idx, g), prompt_ids, res in zip(plan.members, prompts, results, strict=True):
        meta = res.get("meta_info", {})
        version = meta.get("weight_version")
        if version is not None and int(version) != req.policy_version:
            raise StaleWeights(f"engine {url} serves v{version}, step {req.step} needs v{req.policy_version}")
        lps = [float(t[0]) for t in meta.get("output_token_logprobs", [])]
        if not all(math.isfinite(x) for x in lps):
            raise NonFiniteLogprobs(f"step {req.step} chunk {plan.chunk}: policy v{req.policy_version} logprobs are not finite")
        finish = meta.get("finish_reason") or {}
        samples.append(
            art.Sample(
                sample_id=f"s{req.step}-r{req.round}-p{idx}-g{g}" if req.round else f"s{req.step}-p{idx}-g{g}",
                prompt_index=idx,
                group_index=g,
                prompt_ids=prompt_ids,
                response_ids=list(res["output_ids"]),
                logprobs=lps,
                weight_version=req.policy_version,
                finish_reason=finish.get("type", "stop") if isinstance(finish, dict) else str(finish),
                prompt_text=tokenizer.decode(prompt_ids, skip_special=False),
                response_text=tokenizer.decode(list(res["output_ids"])),
            )
        )
    return art.RolloutChunk(
        run_id=req.run_id, step=req.step, chunk=plan.chunk, seed=plan.seed,
        weight_version=req.policy_version, engine_url=url, samples=samples,
    )


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
    reused = generate_chunks(
        req, list(zip(plans, keys)), store, rows, tokenizer, generate, parallelism=parallelism, on_chunk=on_chunk
    )
    n_tokens, n_samples = 0, 0
    for key in keys:
        chunk = art.get_model(store, key, art.RolloutChunk)
        n_samples += len(chunk.samples)
        n_tokens += sum(len(s.response_ids) for s in chunk.samples)
    seconds = time.perf_counter() - t0
    return RolloutStats(
        chunk_keys=keys,
        n_samples=n_samples,
        gen_tokens=n_tokens,
        response_len_mean=n_tokens / max(1, n_samples),
        tokens_per_s=n_tokens / max(seconds, 1e-9),
        chunks_reused=reused,
        seconds=seconds,
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
) -> int:
    """Generate and store each (plan, key) whose key is not in the store yet,
    ``parallelism`` in flight; the number of chunks found there (reused)."""
    todo = [(p, k) for p, k in planned if not store.exists(k)]
    done = reused = len(planned) - len(todo)

    def work(item: tuple[ChunkPlan, str]) -> None:
        plan, key = item
        art.put_model(store, key, generate_chunk(req, plan, rows, tokenizer, generate))

    with ThreadPoolExecutor(max_workers=max(1, parallelism)) as pool:
        for _ in pool.map(work, todo):
            done += 1
            if on_chunk:
                on_chunk(done, len(planned))
    return reused
