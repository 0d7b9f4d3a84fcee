"""What the base model can do before any training: SmolLM2-135M-Instruct (tests/real_model.py) on
candidate tasks in its own chat format, 100 problems each, greedy and sampled at T = 1, with a cap on
new tokens. Per task and prompt: "answer" = the last number of the reply is right (Milestone's
``math_answer`` rule), "exact" = the reply is the number and nothing else, and how many replies end
(EOS) within the cap. The task of examples/smollm2_times_tables.yaml was chosen from this table
(docs/real-model.md, "Why this task").

    .venv/bin/python -m bench.real_model_probe [--n 100] [--max-new-tokens 16]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gpu_runtime.data.rewards.rules import extract_answer  # noqa: E402
from gpu_runtime.models.causal_lm import load_causal_lm  # noqa: E402
from gpu_runtime.models.tokenizer import Tokenizer  # noqa: E402
from tests.real_model import smollm2_folder  # noqa: E402

# (name, operand range, operator, how the user asks)
TASKS = [
    ("times tables 0..12", (0, 12), "*", "What is {q}?"),
    ("times tables 0..12", (0, 12), "*", "{q}="),
    ("1-digit multiplication", (1, 9), "*", "What is {q}? Reply with only the number."),
    ("2-digit addition", (10, 99), "+", "What is {q}?"),
    ("2-digit addition", (10, 99), "+", "What is {q}? Reply with only the number."),
]


def problems(n: int, lo: int, hi: int, op: str, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        out.append((f"{a}{op}{b}", str(a * b if op == "*" else a + b)))
    return out


@torch.no_grad()
def replies(model: torch.nn.Module, tok: Tokenizer, prompts: list[list[int]], cap: int, temperature: float
            ) -> list[tuple[str, bool]]:
    """(text, ended within the cap) per prompt: HF ``generate``, left-padded with EOS."""
    eos = tok.hf.eos_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sampling = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature,
                                                             "top_p": 1.0, "top_k": 0}
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cap, pad_token_id=eos, eos_token_id=eos,
                         **sampling)
    rows = out[:, width:].tolist()
    return [(tok.decode(r), eos in r) for r in rows]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    folder = smollm2_folder()
    model, tok = load_causal_lm(folder), Tokenizer.load(folder)
    torch.manual_seed(a.seed)
    print(f"| task, prompt | greedy answer | T = 1 answer | exact (greedy / T = 1) | ended within {a.max_new_tokens} |")
    print("|---|---|---|---|---|")
    for name, (lo, hi), op, ask in TASKS:
        probs = problems(a.n, lo, hi, op, a.seed)
        prompts = [tok.encode_chat([{"role": "user", "content": ask.format(q=q)}]) for q, _ in probs]
        cells = []
        for temperature in (0.0, 1.0):
            got = replies(model, tok, prompts, a.max_new_tokens, temperature)
            answer = sum(extract_answer(t) == ans for (t, _), (_, ans) in zip(got, probs)) / a.n
            exact = sum(t.strip() == ans for (t, _), (_, ans) in zip(got, probs)) / a.n
            ended = sum(e for _, e in got) / a.n
            cells.append((answer, exact, ended))
        (g, ge, gend), (s, se, _) = cells
        print(f"| {name}, `{ask.format(q='a' + op + 'b')}` | {g:.0%} | {s:.0%} | {ge:.0%} / {se:.0%} | {gend:.0%} |",
              flush=True)


if __name__ == "__main__":
    main()
