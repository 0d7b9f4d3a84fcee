"""The held-out eval after a step: every eval prompt answered greedily once and
sampled ``k`` times through the node's engines, scored with the math answer rule.

Generation reuses the rollout's chunk mechanics (``cut_chunks``, ``generate_chunks``):
fixed chunks of ``chunk_size`` samples, each with its sampling seed
``derive_seed(base, step, chunk)`` where ``base = derive_seed(run seed, "eval",
sampling)``, stored under deterministic keys, so a retried eval reuses the chunks it
already has and draws the same samples for the rest (the same numbers on CPU).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gpu_runtime.data.evaluation import accuracy, is_correct, pass_at_k
from gpu_runtime.rollout.chunks import RolloutContext, cut_chunks
from gpu_runtime.rollout.dispatch import generate_chunks
from gpu_runtime.rollout.request import RolloutRequest
from gpu_runtime.store import artifacts as art
from spec.rollout import RolloutSpec


@dataclass(frozen=True)
class EvalRequest:
    run_id: str
    step: int
    seed: int  # the run's seed
    policy_version: int  # every answer must come from this version (StaleWeights otherwise)
    k: int
    temperature: float  # of the k samples; the greedy answers use 0
    max_new_tokens: int
    chunk_size: int
    stop: list[str] = field(default_factory=list)  # the rollout's stops: an eval answer ends where a rollout's does
    stop_token_ids: list[int] = field(default_factory=list)


@dataclass
class EvalStats:
    greedy_accuracy: float
    pass_at_k: float
    sampled_accuracy: float  # the mean of the k samples' correctness: pass@1 at the eval temperature
    k: int
    n: int
    seconds: float


def sampling_request(req: EvalRequest, sampling: str, n_rows: int) -> RolloutRequest:
    """The rollout request of one of the two passes (``greedy``: 1 sample at temperature
    0; ``sampled``: ``k`` samples at ``req.temperature``, the full distribution)."""
    greedy = sampling == "greedy"
    rollout = RolloutSpec(
        prompts_per_step=n_rows, group_size=1 if greedy else req.k, chunk_size=req.chunk_size,
        max_new_tokens=req.max_new_tokens, temperature=0.0 if greedy else req.temperature, top_p=1.0, top_k=-1,
        stop=list(req.stop), stop_token_ids=list(req.stop_token_ids),
    )
    return RolloutRequest(
        run_id=req.run_id, step=req.step, seed=art.derive_seed(req.seed, "eval", sampling),
        policy_version=req.policy_version, data_cursor=0, n_rows=n_rows, rollout=rollout,
    )


def run_eval(req: EvalRequest, ctx: RolloutContext) -> EvalStats:
    """Generate (or reuse) both passes over ``ctx.rows`` in order and score them."""
    rows = ctx.rows
    if not rows:
        raise ValueError("the eval split is empty")
    t0 = time.perf_counter()
    correct: dict[str, list[list[bool]]] = {}
    for sampling in ("greedy", "sampled"):
        rreq = sampling_request(req, sampling, len(rows))
        plans = cut_chunks([(i, g) for i in range(len(rows)) for g in range(rreq.rollout.group_size)], rreq)
        planned = [(p, art.eval_chunk_key(req.run_id, req.step, sampling, p.chunk)) for p in plans]
        chunks, _ = generate_chunks(rreq, planned, ctx)
        flags: list[list[bool]] = [[] for _ in rows]
        for chunk in chunks:
            for s in chunk.samples:
                flags[s.prompt_index].append(is_correct(s.response_text, rows[s.prompt_index]))
        correct[sampling] = flags
    return EvalStats(
        greedy_accuracy=accuracy([f[0] for f in correct["greedy"]]),
        pass_at_k=pass_at_k(correct["sampled"], req.k),
        sampled_accuracy=accuracy([c for f in correct["sampled"] for c in f]),
        k=req.k,
        n=len(rows),
        seconds=time.perf_counter() - t0,
    )
