"""In-process pieces shared by the RL benchmarks: the demo config, its dataset, a
rollout that calls ``generate_batch`` directly (no engine server, no router, no Temporal),
and ``PlainLoop``, a run's recipe in one process.

The rollout cuts the step into the same chunks with the same seeds as
``gpu_runtime.rollout.chunks.plan_chunks`` and generates each chunk as one batch, exactly
as a torch engine does, so on CPU its tokens equal those of a real run, and a plain loop
ends bitwise equal to the run (``tests/e2e/test_rl_run.py`` checks it).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
from transformers import PreTrainedModel

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from activities import translate  # noqa: E402
from gpu_runtime.data.rewards import score_samples  # noqa: E402
from gpu_runtime.data.datasets import generate_arithmetic, load_jsonl, write_jsonl  # noqa: E402
from gpu_runtime.engine.generate import generate_batch  # noqa: E402
from gpu_runtime.models.causal_lm import load_causal_lm  # noqa: E402
from gpu_runtime.models.tokenizer import Tokenizer  # noqa: E402
from gpu_runtime.rollout.chunks import plan_chunks  # noqa: E402
from gpu_runtime.rollout.request import RolloutRequest  # noqa: E402
from gpu_runtime.rollout.single_turn import generate_chunk  # noqa: E402
from gpu_runtime.store import artifacts as art  # noqa: E402
from gpu_runtime.store.object_store import ObjectStore  # noqa: E402
from gpu_runtime.trainer.base_model import base_model_folder  # noqa: E402
from gpu_runtime.trainer.policy.trainer import PolicyTrainer  # noqa: E402
from milestone_cli.config_file import load_run_config  # noqa: E402
from spec.run import RunConfig  # noqa: E402
from spec.trainer_rpc import RunSetup, StepBatch  # noqa: E402
from workflows.contracts.placement import DatasetInfo  # noqa: E402
from workflows.contracts.sampling import RolloutInput  # noqa: E402

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
    """What ``init_policy`` sends the trainer for this config (as ``TrainingRun`` builds it)."""
    return RunSetup(
        run_id=run_id, store_uri=cfg.store, seed=cfg.seed, model=cfg.model, sft=cfg.sft, hparams=cfg.train,
        dataset_key=art.dataset_key(run_id, "train"), keep_last=cfg.checkpoint.keep_last,
        keep_versions=cfg.checkpoint.keep_versions, config_hash=run_id, distill=cfg.distill, trainer=cfg.trainer,
    )


def step_batch(cfg: RunConfig, run_id: str, step: int, chunk_keys: list[str], rewards_key: str) -> StepBatch:
    """What ``train_step`` sends the trainer for step ``step`` (as ``RLStep`` builds it)."""
    return StepBatch(
        step=step, policy_version=step - 1, chunk_keys=chunk_keys, rewards_key=rewards_key,
        group_size=cfg.rollout.group_size, hparams=cfg.train, temperature=cfg.rollout.temperature,
    )


def dataset_rows(cfg: RunConfig, path: Path) -> list[dict]:
    """The rows ``prepare_data`` writes for this config (written and read back as JSONL).
    Every data field counts: without ``min_operand`` (demo.yaml sets 10) the plain loop of
    ``bench_rl_step`` trained on other prompts and was never bitwise equal to the run."""
    d = cfg.data
    write_jsonl(generate_arithmetic(d.num_train, cfg.seed, d.max_operand, d.ops, min_operand=d.min_operand), path)
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


def store_rollout(
    store: ObjectStore, cfg: RunConfig, run_id: str, step: int, folder: Path, rows: list[dict]
) -> tuple[list[str], list[art.Sample]]:
    """Step ``step``'s rollout generated (``generate_step``) with the weights in ``folder``,
    its chunks stored where the node agent leaves them: the chunk keys and the samples."""
    chunks = generate_step(load_causal_lm(folder).eval(), rollout_request(cfg, run_id, step, len(rows)), rows,
                           Tokenizer.load(folder))
    keys = [art.rollout_chunk_key(run_id, step, c.chunk) for c in chunks]
    for key, chunk in zip(keys, chunks):
        art.put_model(store, key, chunk)
    return keys, [s for c in chunks for s in c.samples]


class PlainLoop:
    """A sync RL run's recipe in one process and one copy of each piece: the SFT
    warm-up, then per step the same chunks generated in-process, ``score_samples``,
    ``PolicyTrainer.train_step`` and a weight copy into the generating model. What a
    Milestone run does across Temporal, engine and trainer processes, without them."""

    def __init__(self, cfg: RunConfig, work: Path, run_id: str = "plain") -> None:
        self.cfg, self.run_id = cfg, run_id
        self.rows = dataset_rows(cfg, work / "train.jsonl")
        self.by_index = dict(enumerate(self.rows))
        self.setup = run_setup(cfg, run_id)
        folder = base_model_folder(self.setup.model, self.rows, cfg.seed, work)
        self.trainer = PolicyTrainer.create(folder, self.setup.hparams, cfg.seed)
        self.tok = self.trainer.tokenizer
        self.reward_spec = cfg.reward
        self.gen_model: PreTrainedModel | None = None  # the "engine": a second copy of the weights

    def sft(self) -> None:
        s = self.cfg.sft
        self.trainer.sft_warmup(self.rows, s.steps, s.batch_size, s.lr, self.cfg.seed, s.grad_clip, betas=s.betas)
        self.gen_model = copy.deepcopy(self.trainer.model).eval()

    def rollout(self, step: int) -> list[art.Sample]:
        assert self.gen_model is not None, "sft() first"
        chunks = generate_step(self.gen_model, rollout_request(self.cfg, self.run_id, step, len(self.rows)),
                               self.rows, self.tok)
        return [s for c in chunks for s in c.samples]

    def rewards(self, samples: list[art.Sample]) -> list[float]:
        return [r.reward for r in score_samples(samples, self.by_index, self.reward_spec)]

    def train(self, samples: list[art.Sample], rewards: list[float]) -> dict[str, float]:
        return self.trainer.train_step(samples, rewards, self.cfg.rollout.group_size, self.setup.hparams,
                                       self.cfg.rollout.temperature)

    def update_weights(self) -> None:
        assert self.gen_model is not None
        self.gen_model.load_state_dict(self.trainer.model.state_dict())

    def run(self, steps: int) -> list[dict[str, float]]:
        """SFT, then ``steps`` steps; each step's train metrics."""
        self.sft()
        out = []
        for step in range(1, steps + 1):
            samples = self.rollout(step)
            out.append(self.train(samples, self.rewards(samples)))
            self.update_weights()
        return out
