"""The held-out eval: pass@k and accuracy against hand-computed numbers, the held-out
arithmetic split, and ``run_eval`` through a stand-in engine and a real tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gpu_runtime.data.arithmetic import generate_arithmetic, generate_heldout_arithmetic
from gpu_runtime.data.evaluation import accuracy, is_correct, pass_at_k, pass_at_k_estimate
from gpu_runtime.engine.generate import generate_batch
from gpu_runtime.rollout.chunks import RolloutContext, StaleWeights
from gpu_runtime.rollout.evaluate import EvalRequest, run_eval, sampling_request
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.uri import open_store
from tests.engine_fixtures import _tokenizer, tiny_model

ROWS = generate_arithmetic(3, seed=5, max_operand=9)
REQ = EvalRequest(run_id="r", step=2, seed=5, policy_version=2, k=4, temperature=1.0, max_new_tokens=3, chunk_size=5)


# ---- scoring ------------------------------------------------------------------------------
def test_pass_at_k_estimate_hand_computed() -> None:
    assert pass_at_k_estimate(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k_estimate(4, 1, 1) == pytest.approx(0.25)  # pass@1 = c/n
    assert pass_at_k_estimate(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert pass_at_k_estimate(4, 0, 4) == 0.0
    assert pass_at_k_estimate(4, 3, 2) == 1.0  # n - c < k: every draw of 2 holds a correct one


def test_pass_at_k_with_k_samples_is_any_of_k() -> None:
    correct = [[True, False, False, False], [False] * 4, [True, True, False, False]]
    assert pass_at_k(correct) == pytest.approx(2 / 3)
    assert pass_at_k(correct, 4) == pytest.approx(2 / 3)
    # k = 2 from 4 samples: (1 - C(3,2)/C(4,2)) = 0.5, 0, (1 - C(2,2)/C(4,2)) = 5/6
    assert pass_at_k(correct, 2) == pytest.approx((0.5 + 0 + 5 / 6) / 3)
    assert pass_at_k(correct, 1) == pytest.approx((1 / 4 + 0 + 2 / 4) / 3)


def test_accuracy_and_errors() -> None:
    assert accuracy([True, False, True, True]) == 0.75
    with pytest.raises(ValueError):
        accuracy([])
    with pytest.raises(ValueError):
        pass_at_k([])
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k([[True, False]], 3)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k_estimate(2, 3, 1)


def test_is_correct_is_the_math_answer_rule() -> None:
    row = {"id": "a", "prompt": "2+3=", "messages": None, "answer": "2+3=5\n#### 5", "metadata": {}}
    assert is_correct("5", row) and is_correct("it is 05", row) and not is_correct("6", row) and not is_correct("", row)


# ---- held-out arithmetic ------------------------------------------------------------------
def test_heldout_arithmetic_shares_no_prompt_with_train_and_repeats_none() -> None:
    train = generate_arithmetic(500, seed=3, max_operand=30, ops="+-")
    train_prompts = {r["prompt"] for r in train}
    held = generate_heldout_arithmetic(200, 3, 30, "+-", exclude=train_prompts)
    prompts = [r["prompt"] for r in held]
    assert len(prompts) == 200 and len(set(prompts)) == 200 and not set(prompts) & train_prompts
    assert all(is_correct(r["answer"].rsplit("#### ", 1)[1], r) for r in held)
    assert held == generate_heldout_arithmetic(200, 3, 30, "+-", exclude=train_prompts)  # deterministic
    assert held[0]["id"] == "arith-eval-3-000000"


def test_heldout_arithmetic_stops_when_the_space_runs_out() -> None:
    # 0..2 with '+': 9 prompts; the train set takes some, the held-out split gets exactly the rest
    train_prompts = {r["prompt"] for r in generate_arithmetic(6, seed=1, max_operand=2)}
    held = generate_heldout_arithmetic(100, 1, 2, "+", exclude=train_prompts)
    assert {r["prompt"] for r in held} == {f"{a}+{b}=" for a in range(3) for b in range(3)} - train_prompts
    everything = {f"{a}+{b}=" for a in range(3) for b in range(3)}
    assert generate_heldout_arithmetic(100, 1, 2, "+", exclude=everything) == []



def test_min_operand_draws_two_digit_operands_only_and_bounds_the_heldout_space() -> None:
    rows = generate_arithmetic(400, seed=4, min_operand=10, max_operand=99)
    operands = [int(x) for r in rows for x in r["prompt"][:-1].split("+")]
    assert min(operands) >= 10 and max(operands) <= 99 and min(operands) < 15 and max(operands) > 94
    # 8..9 with '+': 4 prompts in all, whatever the train set took
    train_prompts = {r["prompt"] for r in generate_arithmetic(2, seed=1, min_operand=8, max_operand=9)}
    held = generate_heldout_arithmetic(100, 1, 9, "+", exclude=train_prompts, min_operand=8)
    assert {r["prompt"] for r in held} == {f"{a}+{b}=" for a in (8, 9) for b in (8, 9)} - train_prompts
    with pytest.raises(ValueError, match="min_operand"):
        generate_arithmetic(1, seed=0, min_operand=50, max_operand=20)

# ---- run_eval -----------------------------------------------------------------------------
class StandInEngine:
    """Answers ``a+b=`` prompts: greedy right for the first row only; sampled right for
    every row but the last. Records each request's sampling params."""

    def __init__(self, version: int = 2) -> None:
        self.tok = _tokenizer()
        self.params: list[dict] = []
        self.version = version

    def __call__(self, prompts: list[list[int]], params: dict) -> tuple[list[dict], str]:
        self.params.append(dict(params))
        out = []
        for ids in prompts:
            prompt = self.tok.decode(ids, skip_special=True)
            row = next(r for r in ROWS if r["prompt"] == prompt)
            right = row is ROWS[0] if params["temperature"] == 0 else row is not ROWS[-1]
            answer = row["answer"].rsplit("#### ", 1)[1] if right else "-1"
            out.append({"output_ids": self.tok.encode(answer),
                        "meta_info": {"weight_version": str(self.version), "output_token_logprobs": [[-0.1, 0]]}})
        return out, "http://stand-in"


def test_run_eval_scores_both_passes_and_reuses_stored_chunks(tmp_path: Path) -> None:
    assert len({r["prompt"] for r in ROWS}) == 3
    store = open_store(f"file://{tmp_path}")
    engine = StandInEngine()
    stats = run_eval(REQ, RolloutContext(store, ROWS, _tokenizer(), engine, parallelism=2))
    assert (stats.k, stats.n) == (4, 3)
    assert (stats.greedy_accuracy, stats.pass_at_k) == (pytest.approx(1 / 3), pytest.approx(2 / 3))
    assert stats.sampled_accuracy == pytest.approx(8 / 12)  # the 12 samples' mean: pass@1 at the temperature
    # greedy: 3 samples in 1 chunk at temperature 0; sampled: 12 samples in chunks of 5, 5, 2
    greedy = [p for p in engine.params if p["temperature"] == 0]
    sampled = sorted((p for p in engine.params if p["temperature"] > 0), key=lambda p: p["sampling_seed"])
    assert len(greedy) == 1 and len(sampled) == 3
    base = art.derive_seed(REQ.seed, "eval", "sampled")
    assert [p["sampling_seed"] for p in sampled] == sorted(art.derive_seed(base, REQ.step, c) for c in range(3))
    assert sampling_request(REQ, "sampled", 3).seed == base
    assert all(p["max_new_tokens"] == 3 and p["top_p"] == 1.0 and p["top_k"] == -1 for p in engine.params)
    keys = store.list(art.step_prefix("r", 2) + "/eval/")
    assert len(keys) == 4
    # a retry finds every chunk in the store: no generation, the same numbers
    again = StandInEngine()
    assert run_eval(REQ, RolloutContext(store, ROWS, _tokenizer(), again, parallelism=2)).pass_at_k == stats.pass_at_k
    assert again.params == []


def test_run_eval_refuses_answers_from_other_weights(tmp_path: Path) -> None:
    with pytest.raises(StaleWeights, match="serves v1"):
        run_eval(REQ, RolloutContext(open_store(f"file://{tmp_path}"), ROWS, _tokenizer(), StandInEngine(version=1)))


def test_run_eval_on_a_real_tiny_model_is_deterministic(tmp_path: Path) -> None:
    model, tok = tiny_model(3)

    def engine(prompts: list[list[int]], params: dict) -> tuple[list[dict], str]:
        results = generate_batch(
            model, prompts, max_new_tokens=params["max_new_tokens"], temperature=params["temperature"],
            top_p=params["top_p"], top_k=params["top_k"], seed=params["sampling_seed"], eos_id=tok.eos_token_id,
            pad_id=tok.pad_token_id,
        )
        return [{"output_ids": r.output_ids, "meta_info": {"weight_version": "2",
                 "output_token_logprobs": [[lp, t] for lp, t in zip(r.logprobs, r.output_ids)]}}
                for r in results], "local"

    runs = [run_eval(REQ, RolloutContext(open_store(f"file://{tmp_path / str(i)}"), ROWS, tok, engine))
            for i in range(2)]
    assert (runs[0].greedy_accuracy, runs[0].pass_at_k) == (runs[1].greedy_accuracy, runs[1].pass_at_k)
    assert all(0.0 <= x <= 1.0 and math.isfinite(x) for x in (runs[0].greedy_accuracy, runs[0].pass_at_k))
    chunk = art.eval_chunk_key("r", 2, "sampled", 0)
    assert (tmp_path / "0" / chunk).read_bytes() == (tmp_path / "1" / chunk).read_bytes()
