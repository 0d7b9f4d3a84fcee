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
from transformers import PreTrainedModel

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from activities import translate  # noqa: E402
from gpu_runtime.data.datasets import generate_arithmetic, load_jsonl, write_jsonl  # noqa: E402
from gpu_runtime.engine.generate import generate_batch  # noqa: E402
from gpu_runtime.engine.rollout import RolloutRequest, generate_chunk, plan_chunks  # noqa: E402
from gpu_runtime.models.tokenizer import Tokenizer  # noqa: E402
from gpu_runtime.store import artifacts as art  # noqa: E402
from gpu_runtime.trainer.api import RunSetup, StepBatch  # noqa: E402
from milestone_cli.config_file import load_run_config  # noqa: E402
from workflows.config import RunConfig  # noqa: E402
from workflows.contracts import DatasetInfo, InitPolicyInput, RolloutInput, TrainStepInput  # noqa: E402

DEMO_YAML = ROOT / "examples" / "demo.yaml"


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


def _dataset(cfg: RunConfig, run_id: str) -> DatasetInfo:
    return DatasetInfo(key=art.dataset_key(run_id, "train"), n_rows=cfg.data.num_train, sha256="")


def run_setup(cfg: RunConfig, run_id: str) -> RunSetup:
    """What ``init_policy`` sends the trainer for this config (the activity's own translation)."""
    return translate.run_setup(InitPolicyInput(
        run_id=run_id, store_uri=cfg.store, seed=cfg.seed, model=cfg.model, sft=cfg.sft, train=cfg.train,
        dataset=_dataset(cfg, run_id), checkpoint=cfg.checkpoint, config_hash=run_id, trainer=cfg.trainer,
    ))


def step_batch(cfg: RunConfig, run_id: str, step: int, chunk_keys: list[str], rewards_key: str) -> StepBatch:
    """What ``train_step`` sends the trainer for step ``step`` (the activity's own translation)."""
    return translate.step_batch(TrainStepInput(
        run_id=run_id, step=step, store_uri=cfg.store, policy_version=step - 1, chunk_keys=chunk_keys,
        rewards_key=rewards_key, group_size=cfg.rollout.group_size, train=cfg.train,
    ))


def dataset_rows(cfg: RunConfig, path: Path) -> list[dict]:
    """The rows ``prepare_data`` writes for this config (written and read back as JSONL)."""
    d = cfg.data
    write_jsonl(generate_arithmetic(d.num_train, cfg.seed, d.max_operand, d.ops), path)
    return load_jsonl(path)


def rollout_request(cfg: RunConfig, run_id: str, step: int, n_rows: int) -> RolloutRequest:
    """What the ``rollout`` activity plans for step ``step`` (the activity's own translation)."""
    return translate.rollout_request(RolloutInput(
        run_id=run_id, step=step, store_uri=cfg.store, seed=cfg.seed, policy_version=step - 1,
        data_cursor=(step - 1) * cfg.rollout.prompts_per_step, dataset=_dataset(cfg, run_id), rollout=cfg.rollout,
    ), n_rows)


def generate_step(
    model: PreTrainedModel, req: RolloutRequest, rows: list[dict], tok: Tokenizer
) -> list[art.RolloutChunk]:
    """All chunks of one step through the rollout's own ``generate_chunk``, with one
    in-process ``generate_batch`` call per chunk where a run asks an engine."""

    def generate(prompts: list[list[int]], params: dict) -> tuple[list[dict], str]:
        results = generate_batch(
            model, prompts, max_new_tokens=params["max_new_tokens"], temperature=params["temperature"],
            top_p=params["top_p"], top_k=params["top_k"], seed=params["sampling_seed"],
            eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
        )
        return [
            {"output_ids": r.output_ids, "meta_info": {
                "weight_version": req.policy_version, "finish_reason": {"type": r.finish_reason},
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(r.logprobs, r.output_ids)],
            }}
            for r in results
        ], "in-process"

    with torch.no_grad():
        return [generate_chunk(req, plan, rows, tok, generate) for plan in plan_chunks(req)]
