"""Hugging Face TRL's ``GRPOTrainer`` on one recipe, for ``bench/bench_vs_trl.py``: runs in TRL's
own venv (``make install-trl``: ``.venv-trl``), imports nothing from Milestone.

Reads a JSON job (``--job``) that ``bench_vs_trl`` writes: the base model folder, the training
prompts in the exact order Milestone's run draws them (step ``s`` gets prompts ``s*P .. s*P+P-1``),
the held-out rows, and the hyperparameters. Writes ``--out`` (JSON): the mean reward and the wall
seconds of each step, and the held-out greedy and sampled (T = eval temperature) accuracy before and
after, by HF ``generate`` on the same rows. The reward is Milestone's ``math_answer`` rule (the
integer after the last ``####``, else the last integer), written out again below because this venv
does not hold Milestone: the same two regular expressions as ``rules.extract_answer`` (kept equal by
hand; nothing checks them against each other).

    .venv-trl/bin/python bench/trl_grpo.py --job job.json --out trl.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

_HASH = re.compile(r"####\s*(-?\d+)")
_INT = re.compile(r"-?\d+")


def extract_answer(text: str) -> str | None:
    """Milestone's ``gpu_runtime.data.rewards.rules.extract_answer``."""
    hashes = _HASH.findall(text)
    if hashes:
        return str(int(hashes[-1]))
    ints = _INT.findall(text)
    return str(int(ints[-1])) if ints else None


def completion_text(completion: Any) -> str:
    """A completion as TRL hands it to a reward function: a string, or (a chat prompt) a list of messages."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion)


def answer_reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
    return [1.0 if extract_answer(completion_text(c)) == a else 0.0 for c, a in zip(completions, answer)]


class StepClock(TrainerCallback):
    """Wall seconds of each optimizer step (generation, reward, loss, update) and the logged reward."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.seconds: list[float] = []
        self.rewards: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.t0 = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.seconds.append(time.perf_counter() - self.t0)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any) -> None:
        if logs and "reward" in logs:
            self.rewards.append(float(logs["reward"]))


def held_out(model: Any, tok: Any, job: dict) -> dict[str, float]:
    """Greedy accuracy and sampled (k samples at the eval temperature) accuracy on the held-out rows."""
    rows, k, temp = job["eval_rows"], job["eval_k"], job["eval_temperature"]
    tok.padding_side = "left"
    model.eval()
    greedy: list[bool] = []
    sampled: list[bool] = []
    for start in range(0, len(rows), 25):
        batch = rows[start:start + 25]
        texts = [prompt_text(tok, r["prompt"]) for r in batch]
        # as TRL's GRPOTrainer tokenizes prompts: a plain prompt with the tokenizer's special tokens, a
        # rendered chat as is (its template wrote them)
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=isinstance(batch[0]["prompt"], str))
        with torch.no_grad():
            g = model.generate(**enc, max_new_tokens=job["max_new_tokens"], do_sample=False, pad_token_id=tok.pad_token_id)
            s = model.generate(**enc, max_new_tokens=job["max_new_tokens"], do_sample=True, temperature=temp, top_p=1.0,
                               top_k=0, num_return_sequences=k, pad_token_id=tok.pad_token_id)
        n = enc["input_ids"].shape[1]
        for i, r in enumerate(batch):
            greedy.append(extract_answer(tok.decode(g[i, n:], skip_special_tokens=True)) == r["answer"])
            for j in range(k):
                sampled.append(extract_answer(tok.decode(s[i * k + j, n:], skip_special_tokens=True)) == r["answer"])
    return {"greedy": sum(greedy) / len(greedy), "sampled": sum(sampled) / len(sampled)}


def prompt_text(tok: Any, prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--eval", action="store_true", help="also evaluate the held-out rows before and after")
    a = p.parse_args()
    job = json.loads(open(a.job).read())
    torch.manual_seed(job["seed"])
    tok = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, attn_implementation="eager")
    before = held_out(model, tok, job) if a.eval else None
    P, G = job["prompts_per_step"], job["group_size"]
    train = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in job["train_rows"]])
    cfg = GRPOConfig(
        output_dir=job["workdir"], max_steps=job["steps"], seed=job["seed"], use_cpu=True, report_to="none",
        save_strategy="no", logging_steps=1, disable_tqdm=True, bf16=False, fp16=False,
        per_device_train_batch_size=P * G, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        num_generations=G, shuffle_dataset=False, max_completion_length=job["max_new_tokens"],
        temperature=job["temperature"], top_p=1.0, top_k=0,
        learning_rate=job["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=job["grad_clip"],
        beta=0.0, epsilon=job["clip_eps"], loss_type=job["loss_type"], scale_rewards="group",
        mask_truncated_completions=False, disable_dropout=True, log_completions=False,
    )
    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=[answer_reward], args=cfg, train_dataset=train,
                          processing_class=tok, callbacks=[clock])
    trainer.train()
    after = held_out(trainer.model, tok, job) if a.eval else None
    with open(a.out, "w") as f:
        json.dump({"rewards": clock.rewards, "seconds": clock.seconds, "before": before, "after": after}, f)


if __name__ == "__main__":
    main()
