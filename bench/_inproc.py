"""In-process pieces shared by the RL benchmarks: the demo config, its dataset, and a
rollout that calls ``generate_batch`` directly (no engine server, no router, no Temporal).

The rollout cuts the step into the same chunks with the same seeds as
``gpu_runtime.engine.rollout.plan_chunks`` and generates each chunk as one batch, exactly
as a torch engine does, so on CPU its tokens equal those of a real run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpu_runtime.store import artifacts as art  # noqa: E402
from gpu_runtime.data.datasets import encode_prompt, generate_arithmetic, load_jsonl, write_jsonl  # noqa: E402
from gpu_runtime.engine.generate import generate_batch  # noqa: E402
from gpu_runtime.models.causal_lm import CausalLM  # noqa: E402
from gpu_runtime.engine.rollout import RolloutRequest, plan_chunks  # noqa: E402
from gpu_runtime.models.tokenizer import CharTokenizer  # noqa: E402
from milestone_cli.config_file import load_run_config  # noqa: E402
from workflows.config import RunConfig  # noqa: E402

DEMO_YAML = ROOT / "examples" / "demo.yaml"
# the train fields the node agent forwards to the trainer (activities.node.TRAIN_TO_TRAINER)
TRAINER_FIELDS = {"lr", "clip_eps", "kl_coef", "grad_clip", "weight_decay", "ppo_epochs"}


def demo_config(store_dir: Path, *, steps: int, sft_steps: int, every: int, keep_last: int, name: str) -> RunConfig:
    """examples/demo.yaml (model, data, rollout, train as is) with a short run in a temp store."""
    base = load_run_config(DEMO_YAML)
    return base.model_copy(update={
        "name": name,
        "steps": steps,
        "store": f"file://{store_dir}",
        "sft": base.sft.model_copy(update={"steps": sft_steps}),
        "checkpoint": base.checkpoint.model_copy(update={"every": every, "keep_last": keep_last}),
    })


def trainer_hparams(cfg: RunConfig) -> dict:
    return {k: v for k, v in cfg.train.model_dump().items() if k in TRAINER_FIELDS}


def dataset_rows(cfg: RunConfig, path: Path) -> list[dict]:
    """The rows ``prepare_data`` writes for this config (written and read back as JSONL)."""
    d = cfg.data
    write_jsonl(generate_arithmetic(d.num_train, cfg.seed, d.max_operand, d.ops), path)
    return load_jsonl(path)


def rollout_request(cfg: RunConfig, run_id: str, step: int, n_rows: int) -> RolloutRequest:
    r = cfg.rollout
    return RolloutRequest(
        run_id=run_id, step=step, seed=cfg.seed, policy_version=step - 1,
        data_cursor=(step - 1) * r.prompts_per_step, n_rows=n_rows, prompts_per_step=r.prompts_per_step,
        group_size=r.group_size, chunk_size=r.chunk_size, max_new_tokens=r.max_new_tokens,
        temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
    )


def generate_step(
    model: CausalLM, req: RolloutRequest, rows: list[dict], tok: CharTokenizer
) -> list[art.RolloutChunk]:
    """All chunks of one step, one ``generate_batch`` call per chunk, in order."""
    chunks = []
    with torch.no_grad():
        for plan in plan_chunks(req):
            prompts = [encode_prompt(tok, rows[idx]) for idx, _ in plan.members]
            results = generate_batch(
                model, prompts, max_new_tokens=req.max_new_tokens, temperature=req.temperature,
                top_p=req.top_p, top_k=req.top_k, seed=plan.seed, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
            )
            samples = [
                art.Sample(
                    sample_id=f"s{req.step}-p{idx}-g{g}", prompt_index=idx, group_index=g, prompt_ids=p,
                    response_ids=list(res.output_ids), logprobs=list(res.logprobs),
                    weight_version=req.policy_version, finish_reason=res.finish_reason,
                )
                for (idx, g), p, res in zip(plan.members, prompts, results, strict=True)
            ]
            chunks.append(art.RolloutChunk(
                run_id=req.run_id, step=req.step, chunk=plan.chunk, seed=plan.seed,
                weight_version=req.policy_version, engine_url="in-process", samples=samples,
            ))
    return chunks
