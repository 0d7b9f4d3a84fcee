"""The chunk primitives of a rollout: a step's samples in a fixed order, cut into fixed
chunks (the unit of generation, storage and retry), each sampled with its own seed; and
one batch through the engines, its results checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from gpu_runtime.data.datasets import prompts_for_step
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.rollout.request import RolloutRequest
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.object_store import ObjectStore

# (batch of input ids, sampling params) -> (one SGLang-shaped result per prompt, engine url)
ChunkGenerator = Callable[[list[list[int]], dict], tuple[list[dict], str]]


@dataclass(frozen=True)
class RolloutContext:
    """What the node gives a rollout or an eval: the store its chunks go to, the split's rows,
    the served model's tokenizer, the engines (``generate``), how many chunks are in flight at
    once, and ``on_chunk(done, total)`` after each chunk."""

    store: ObjectStore
    rows: list[dict]
    tokenizer: Tokenizer
    generate: ChunkGenerator
    parallelism: int = 1
    on_chunk: Callable[[int, int], None] | None = None
    pin: Callable[[str], ChunkGenerator] | None = None  # a key -> ``generate`` kept to one engine (agent episodes)


class NonFiniteLogprobs(RuntimeError):
    """The policy produced NaN/inf: the run has diverged (not retryable)."""


class StaleWeights(RuntimeError):
    """An engine answered with weights other than the step's policy version."""


@dataclass(frozen=True)
class ChunkPlan:
    chunk: int
    seed: int
    members: list[tuple[int, int]]  # (dataset index, group index)


def plan_chunks(req: RolloutRequest) -> list[ChunkPlan]:
    """The step's samples, in a fixed order, cut into fixed chunks (DESIGN §5-6)."""
    indices = prompts_for_step(req.n_rows, req.seed, req.data_cursor, req.rollout.prompts_per_step)
    return cut_chunks([(idx, g) for idx in indices for g in range(req.rollout.group_size)], req)


def cut_chunks(members: list[tuple[int, int]], req: RolloutRequest) -> list[ChunkPlan]:
    """``members`` in order, ``req.rollout.chunk_size`` per chunk; chunk ``c`` samples with seed
    ``derive_seed(req.seed, req.step, c)`` (round ``r`` > 0 of dynamic sampling:
    ``derive_seed(req.seed, req.step, "round", r, c)``)."""
    return [
        ChunkPlan(
            chunk=c,
            seed=(art.derive_seed(req.seed, req.step, "round", req.round, c) if req.round
                  else art.derive_seed(req.seed, req.step, c)),
            members=members[start : start + req.rollout.chunk_size],
        )
        for c, start in enumerate(range(0, len(members), req.rollout.chunk_size))
    ]


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
            raise NonFiniteLogprobs(
                f"step {req.step} chunk {plan.chunk}: policy v{req.policy_version} logprobs are not finite"
            )
        finish = meta.get("finish_reason") or {}
        reason = finish.get("type", "stop") if isinstance(finish, dict) else str(finish)
        out.append((list(res["output_ids"]), lps, reason))
    return out, url
