"""The plain reference: SFT -> GRPO on a transformers model in one process.

No Temporal, no subprocesses, nothing from Milestone's trainer / engine /
algorithms: only torch, transformers, the arithmetic data generator, the
model-folder factory and the data order (``derive_seed`` for the SFT batches,
``prompts_for_step`` for the RL prompts), so both sides of a parity check see the
same inputs in the same order.
Meant to be read top to bottom and checked by eye.

Data: ``generate_arithmetic(n_train + more, seed=data_seed)`` is one seeded
stream; the first ``n_train`` rows are the train set (the same rows Milestone's
run of that seed trains on) and the held-out set is the next rows whose prompt
is not in the train set, first occurrence only (a tail split, no shared prompt).
Prompt = ``prompt_text(row)`` (``"23+45="``) tokenized raw (no chat template)
with the tokenizer's special tokens, i.e. BOS first when the tokenizer has one
(the factory's does; ``--no-bos`` builds one without); SFT target =
``sft_target(row)`` tokens + EOS.

SFT: ``steps`` batches of ``batch_size`` rows drawn with replacement (seeded per step),
loss = mean NLL over target tokens of the batch, AdamW at a constant lr.
GRPO: per step ``prompts`` prompts (a seeded permutation of the train rows,
epoch after epoch) x ``group`` samples at ``temperature`` (top_p 1, no top_k) up
to ``max_new_tokens``, stopping at EOS; reward 1 if the last integer in the
response equals the answer, else 0; advantages (r - mean) / (std + 1e-6) per
group; PPO-clip loss, token mean over all response tokens of the batch; one
AdamW step per rollout (old logprobs = current ones, so the ratio is exactly 1);
optional k3 KL to the frozen post-SFT model. Held-out greedy accuracy is taken
after SFT and after RL.

    python -m bench.plain_grpo [--seed 0] [--rl-steps 150] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_runtime.data.datasets import (  # noqa: E402
    final_answer, generate_arithmetic, prompt_text, prompts_for_step, sft_target,
)
from gpu_runtime.store.artifacts import derive_seed  # noqa: E402
from gpu_runtime.models.hf_factory import init_model_folder, train_bpe_tokenizer  # noqa: E402

_INT = re.compile(r"-?\d+")


# ---------------------------------------------------------------- inputs
def split_rows(
    n_train: int, n_heldout: int, data_seed: int, max_operand: int = 99, min_operand: int = 0
) -> tuple[list[dict], list[dict]]:
    """Train rows = the first ``n_train`` rows of the seeded stream; held-out =
    the following rows with a prompt unseen in train (and not repeated)."""
    n = n_train + 2 * n_heldout
    while True:
        rows = generate_arithmetic(n, data_seed, max_operand, "+", min_operand=min_operand)
        train, seen, heldout = rows[:n_train], {prompt_text(r) for r in rows[:n_train]}, []
        for r in rows[n_train:]:
            if prompt_text(r) not in seen and len(heldout) < n_heldout:
                seen.add(prompt_text(r))
                heldout.append(r)
        if len(heldout) == n_heldout or n > 20 * (n_train + n_heldout):
            return train, heldout
        n *= 2


def make_model_folder(out_dir: Path, train_rows: list[dict], args: argparse.Namespace) -> Path:
    """A BPE tokenizer trained on the train rows' text and a random-init model."""
    tok = train_bpe_tokenizer([prompt_text(r) + "\n" + r["answer"] for r in train_rows], args.vocab_size,
                              add_bos=not args.no_bos)
    return init_model_folder(
        out_dir, arch=args.arch, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions, tokenizer=tok, seed=args.seed,
        tie_word_embeddings=not args.untied,
    )


def load_policy(folder: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return model, tok


def encode_prompt(tok: PreTrainedTokenizerBase, row: dict) -> list[int]:
    """``prompt_text(row)`` tokens, after the BOS if the tokenizer adds one."""
    return tok(prompt_text(row))["input_ids"]


def answer_of(text: str) -> str | None:
    """The last integer in ``text``, normalised (``"07"`` -> ``"7"``); None if there is none."""
    ints = _INT.findall(text)
    return str(int(ints[-1])) if ints else None


# ---------------------------------------------------------------- batching
def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return ids, mask


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    return ids, mask


def completion_logprobs(
    model: PreTrainedModel, prompts: list[list[int]], completions: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log p of every completion token given everything before it: ``[B, T-1]``,
    and the mask ``[B, T-1]`` that is 1 exactly on completion tokens (right-padded,
    so positions 0.. of each row are its real tokens)."""
    ids, attn = right_pad([p + c for p, c in zip(prompts, completions)], pad_id)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    target_pos = torch.arange(ids.shape[1] - 1)[None, :] + 1  # entry j predicts token j+1
    start = torch.tensor([len(p) for p in prompts])[:, None]
    end = torch.tensor([len(p) + len(c) for p, c in zip(prompts, completions)])[:, None]
    return logp, ((target_pos >= start) & (target_pos < end)).float()


@torch.no_grad()
def generate(
    model: PreTrainedModel, prompts: list[list[int]], eos_id: int, *, max_new_tokens: int, temperature: float | None
) -> list[list[int]]:
    """One response per prompt (greedy when ``temperature`` is None), cut after
    the first EOS (kept: the policy is trained to emit it)."""
    model.eval()
    ids, attn = left_pad(prompts, eos_id)
    sampling = {"do_sample": False} if temperature is None else {
        "do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens, eos_token_id=eos_id,
                         pad_token_id=eos_id, **sampling)
    responses = []
    for row in out[:, ids.shape[1]:].tolist():
        responses.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
    return responses


# ---------------------------------------------------------------- SFT
def lr_factor(step: int, steps: int, schedule: str, warmup: int) -> float:
    """The lr multiplier of optimizer step ``step`` (0-based) of ``steps``: linear
    warm-up over ``warmup`` steps, then constant, linear or cosine decay to 0."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    frac = (step - warmup) / max(steps - warmup, 1)
    if schedule == "linear":
        return 1.0 - frac
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * frac))
    raise ValueError(f"schedule must be constant, linear or cosine, got {schedule!r}")


def sft(
    model: PreTrainedModel, tok: PreTrainedTokenizerBase, rows: list[dict], *, steps: int, batch_size: int,
    lr: float, seed: int, grad_clip: float | None = None, weight_decay: float = 0.0, log_every: int = 50,
    schedule: str = "constant", warmup: int = 0, betas: tuple[float, float] = (0.9, 0.95),
) -> dict:
    """Supervised warm-up on prompt -> answer + EOS; loss on the answer tokens only."""
    eos = tok.eos_token_id
    data = [(encode_prompt(tok, r), tok(sft_target(r), add_special_tokens=False)["input_ids"] + [eos]) for r in rows]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=1e-8, weight_decay=weight_decay)
    model.train()
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * lr_factor(step, steps, schedule, warmup)
        rng = random.Random(derive_seed("sft", seed, step))  # the rows a Milestone run of this seed draws
        batch = [data[rng.randrange(len(data))] for _ in range(batch_size)]
        logp, mask = completion_logprobs(model, [p for p, _ in batch], [c for _, c in batch], eos)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"sft step {step + 1:4d}  loss {statistics.fmean(losses[-log_every:]):.4f}", flush=True)
    secs = time.perf_counter() - t0
    return {"sft_seconds": secs, "sft_s_per_step": secs / max(steps, 1), "sft_loss_first": losses[0] if losses else None,
            "sft_loss_last": losses[-1] if losses else None}


# ---------------------------------------------------------------- GRPO
def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-6)).view(-1)


def grpo_update(
    model: PreTrainedModel, optimizer: torch.optim.Optimizer, prompts: list[list[int]], responses: list[list[int]],
    rewards: list[float], *, group: int, pad_id: int, clip: float, grad_clip: float, kl_coef: float = 0.0,
    ref_model: PreTrainedModel | None = None,
) -> dict:
    """One optimizer step on one rollout. ``prompts[i]`` / ``responses[i]`` /
    ``rewards[i]`` per sample, each group of ``group`` samples contiguous."""
    model.train()
    adv = group_advantages(torch.tensor(rewards, dtype=torch.float32), group)[:, None]
    logp, mask = completion_logprobs(model, prompts, responses, pad_id)
    old_logp = logp.detach()  # the rollout policy is the current one: ratio == 1
    ratio = torch.exp(logp - old_logp)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip))
    kl = torch.zeros(())
    if kl_coef > 0:
        assert ref_model is not None, "kl_coef > 0 needs ref_model"
        with torch.no_grad():
            ref_logp, _ = completion_logprobs(ref_model, prompts, responses, pad_id)
        d = ref_logp - logp
        per_token_kl = torch.exp(d) - d - 1  # k3
        kl = (per_token_kl * mask).sum() / mask.sum()
        per_token = per_token + kl_coef * per_token_kl
    loss = (per_token * mask).sum() / mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return {"loss": loss.item(), "kl": kl.item(), "grad_norm": grad_norm.item(),
            "response_len": float(mask.sum().item()) / len(responses)}


def grpo_step(
    model: PreTrainedModel, optimizer: torch.optim.Optimizer, tok: PreTrainedTokenizerBase, rows: list[dict], *,
    group: int, max_new_tokens: int, temperature: float, clip: float, grad_clip: float, kl_coef: float = 0.0,
    ref_model: PreTrainedModel | None = None,
) -> dict:
    """Sample ``group`` responses for each row, score them, take one GRPO update."""
    eos = tok.eos_token_id
    t0 = time.perf_counter()
    prompts = [encode_prompt(tok, r) for r in rows for _ in range(group)]
    responses = generate(model, prompts, eos, max_new_tokens=max_new_tokens, temperature=temperature)
    answers = [final_answer(r) for r in rows for _ in range(group)]
    rewards = [float(answer_of(tok.decode(resp, skip_special_tokens=True)) == a) for resp, a in zip(responses, answers)]
    t1 = time.perf_counter()
    stats = grpo_update(model, optimizer, prompts, responses, rewards, group=group, pad_id=eos, clip=clip,
                        grad_clip=grad_clip, kl_coef=kl_coef, ref_model=ref_model)
    t2 = time.perf_counter()
    return {"reward": statistics.fmean(rewards), "gen_s": t1 - t0, "train_s": t2 - t1, **stats}


def prompt_rows(train: list[dict], step: int, count: int, seed: int) -> list[dict]:
    """Rows at positions ``step*count ..`` of the seeded permutation (re-shuffled each
    epoch) that a Milestone run of this seed walks through."""
    return [train[i] for i in prompts_for_step(len(train), seed, step * count, count)]


@torch.no_grad()
def greedy_accuracy(
    model: PreTrainedModel, tok: PreTrainedTokenizerBase, rows: list[dict], *, max_new_tokens: int,
    batch_size: int = 250,
) -> float:
    correct = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        responses = generate(model, [encode_prompt(tok, r) for r in chunk], tok.eos_token_id,
                             max_new_tokens=max_new_tokens, temperature=None)
        correct += sum(answer_of(tok.decode(resp, skip_special_tokens=True)) == final_answer(r)
                       for resp, r in zip(responses, chunk))
    return correct / len(rows)


# ---------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = ap.add_argument
    a("--model", type=Path, help="an existing model folder; default: build one (BPE on the train rows + random init)")
    a("--save-model", type=Path, help="where to build the model folder (default: a temp dir)")
    a("--arch", choices=["qwen2", "llama"], default="qwen2")
    a("--hidden", type=int, default=256)
    a("--intermediate", type=int, default=1024)
    a("--layers", type=int, default=4)
    a("--heads", type=int, default=4)
    a("--kv-heads", type=int, default=4)
    a("--max-positions", type=int, default=64)
    a("--vocab-size", type=int, default=512, help="BPE vocab size cap (the arithmetic texts give fewer merges)")
    a("--untied", action="store_true", help="separate input embedding and LM head (Qwen2's default)")
    a("--no-bos", action="store_true", help="build the tokenizer without BOS (prompts start with their first digit)")
    a("--seed", type=int, default=0, help="model init, SFT batches, prompt order, sampling")
    a("--data-seed", type=int, help="dataset stream (default: --seed, as in a Milestone run)")
    a("--n-train", type=int, default=2000)
    a("--min-operand", type=int, default=0, help="operands from min..max (10..99: 2-digit addition)")
    a("--max-operand", type=int, default=99)
    a("--n-heldout", type=int, default=500)
    a("--sft-steps", type=int, default=300)
    a("--sft-batch", type=int, default=64)
    a("--sft-lr", type=float, default=3e-4)
    a("--sft-schedule", choices=["constant", "linear", "cosine"], default="constant", help="SFT lr schedule")
    a("--sft-warmup", type=int, default=0, help="SFT linear lr warm-up steps")
    a("--sft-beta2", type=float, default=0.95, help="AdamW beta2 in SFT (0.999 learns slower here: see README)")
    a("--sft-grad-clip", type=float, help="max grad norm in SFT (default: no clipping)")
    a("--rl-steps", type=int, default=150)
    a("--prompts", type=int, default=16)
    a("--group", type=int, default=8)
    a("--rl-lr", type=float, default=3e-5)
    a("--clip", type=float, default=0.2)
    a("--kl", type=float, default=0.0, help="k3 KL coefficient to the frozen post-SFT model")
    a("--grad-clip", type=float, default=1.0)
    a("--weight-decay", type=float, default=0.0, help="AdamW weight decay (SFT and RL)")
    a("--max-new-tokens", type=int, default=6)
    a("--temperature", type=float, default=1.0)
    a("--threads", type=int, default=1)
    a("--log-every", type=int, default=10)
    a("--json", type=Path, help="write the summary numbers here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    t_start = time.perf_counter()
    data_seed = args.seed if args.data_seed is None else args.data_seed
    train, heldout = split_rows(args.n_train, args.n_heldout, data_seed, args.max_operand, args.min_operand)
    with tempfile.TemporaryDirectory(prefix="plain-grpo-") as tmp:
        folder = args.model or make_model_folder(args.save_model or Path(tmp) / "model", train, args)
        model, tok = load_policy(folder)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__} {n_params / 1e6:.2f} M params, vocab {len(tok)}, {len(train)} train rows, "
          f"{len(heldout)} held-out rows, seed {args.seed}, {args.threads} thread(s)", flush=True)

    sft_stats = sft(model, tok, train, steps=args.sft_steps, batch_size=args.sft_batch, lr=args.sft_lr, seed=args.seed,
                    grad_clip=args.sft_grad_clip, weight_decay=args.weight_decay,
                    schedule=args.sft_schedule, warmup=args.sft_warmup, betas=(0.9, args.sft_beta2))
    acc_sft = greedy_accuracy(model, tok, heldout, max_new_tokens=args.max_new_tokens)
    print(f"after SFT: held-out greedy accuracy {acc_sft:.3f}  ({sft_stats['sft_s_per_step']:.3f} s/step)", flush=True)

    ref = None
    if args.kl > 0:
        ref = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.rl_lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=args.weight_decay)
    torch.manual_seed(args.seed)  # the sampling noise
    steps = []
    t_rl = time.perf_counter()
    for step in range(args.rl_steps):
        rows = prompt_rows(train, step, args.prompts, args.seed)
        s = grpo_step(model, opt, tok, rows, group=args.group, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, clip=args.clip, grad_clip=args.grad_clip, kl_coef=args.kl,
                      ref_model=ref)
        steps.append(s)
        if args.log_every and ((step + 1) % args.log_every == 0 or step == 0):
            last = steps[-args.log_every:]
            print(f"rl step {step + 1:4d}  reward {s['reward']:.3f}  (mean of last {len(last)}: "
                  f"{statistics.fmean(x['reward'] for x in last):.3f})  len {s['response_len']:.2f}  "
                  f"grad_norm {s['grad_norm']:.3f}  gen {s['gen_s']:.2f}s train {s['train_s']:.2f}s", flush=True)
    rl_seconds = time.perf_counter() - t_rl
    acc_rl = greedy_accuracy(model, tok, heldout, max_new_tokens=args.max_new_tokens) if args.rl_steps else acc_sft
    rewards = [s["reward"] for s in steps]
    k = min(20, len(rewards))
    summary = {
        "seed": args.seed, "data_seed": data_seed, "threads": args.threads, "params": n_params, "vocab": len(tok),
        "sft_steps": args.sft_steps, "rl_steps": args.rl_steps,
        "sft_s_per_step": sft_stats["sft_s_per_step"], "rl_s_per_step": rl_seconds / max(args.rl_steps, 1),
        "rl_gen_s_per_step": statistics.fmean(s["gen_s"] for s in steps) if steps else None,
        "rl_train_s_per_step": statistics.fmean(s["train_s"] for s in steps) if steps else None,
        "reward_first20": statistics.fmean(rewards[:k]) if k else None,
        "reward_last20": statistics.fmean(rewards[-k:]) if k else None,
        "heldout_acc_sft": acc_sft, "heldout_acc_rl": acc_rl,
        "sft_loss_last": sft_stats["sft_loss_last"], "wall_s": time.perf_counter() - t_start,
        "rewards": rewards, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    print()
    print(f"{'':32}{'value':>10}")
    for label, key, fmt in (
        ("seconds per SFT step", "sft_s_per_step", ".3f"), ("seconds per RL step", "rl_s_per_step", ".3f"),
        ("  of which generation", "rl_gen_s_per_step", ".3f"), ("  of which update", "rl_train_s_per_step", ".3f"),
        (f"RL reward, first {k} steps", "reward_first20", ".3f"), (f"RL reward, last {k} steps", "reward_last20", ".3f"),
        ("held-out greedy acc after SFT", "heldout_acc_sft", ".3f"),
        ("held-out greedy acc after RL", "heldout_acc_rl", ".3f"), ("wall seconds", "wall_s", ".0f"),
    ):
        v = summary[key]
        print(f"{label:32}{'-' if v is None else format(v, fmt):>10}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
