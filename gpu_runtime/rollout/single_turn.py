"""One chunk as single-turn samples: each member's prompt answered once, the whole chunk
generated as one batch (so on CPU its tokens do not depend on the engine that ran it)."""

from __future__ import annotations

from typing import Any

from gpu_runtime.data.datasets import encode_prompt
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.rollout.chunks import ChunkGenerator, ChunkPlan, generate_checked, sample_id
from gpu_runtime.rollout.request import RolloutRequest
from gpu_runtime.store import artifacts as art


def generate_chunk(
    req: RolloutRequest, plan: ChunkPlan, rows: list[dict], tokenizer: Tokenizer, generate: ChunkGenerator
) -> art.RolloutChunk:
    prompts = [encode_prompt(tokenizer, rows[idx]) for idx, _ in plan.members]
    params: dict[str, Any] = {
        "max_new_tokens": req.rollout.max_new_tokens,
        "temperature": req.rollout.temperature,
        "top_p": req.rollout.top_p,
        "top_k": req.rollout.top_k,
        "sampling_seed": plan.seed,
    }
    if req.rollout.stop:  # SGLang's names; left out when unset, so such requests stay as they were
        params["stop"] = list(req.rollout.stop)
    if req.rollout.stop_token_ids:
        params["stop_token_ids"] = list(req.rollout.stop_token_ids)
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
