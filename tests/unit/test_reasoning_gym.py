"""``data.kind: reasoning_gym``: rows generated offline (deterministic, a held-out split
disjoint from the train set) by prepare_data on a real store, scored by the generator's
own scorer as ``reward.kind: reasoning_gym`` and in the held-out eval; config rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import reasoning_gym as reasoning_gym_package  # noqa: F401  (a dev dependency: imported, so a broken install fails loudly)
from pydantic import ValidationError
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.control import prepare_data
from gpu_runtime.data import reasoning_gym
from gpu_runtime.data.datasets import load_jsonl
from gpu_runtime.data.evaluation import is_correct
from gpu_runtime.data.rewards import score_samples
from gpu_runtime.store import artifacts as art
from spec.data import DataSpec
from spec.reward import RewardSpec
from spec.run import EvalSpec, RunConfig
from workflows.contracts.placement import PrepareDataInput
from workflows.failures import Failure

CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_rows_are_deterministic_normalized_and_carry_their_entry() -> None:
    a = reasoning_gym.generate_rows("chain_sum", CHAIN, 5, seed=3)
    assert a == reasoning_gym.generate_rows("chain_sum", CHAIN, 5, seed=3)
    assert a != reasoning_gym.generate_rows("chain_sum", CHAIN, 5, seed=4)
    row = a[0]
    assert row["id"] == "rg-chain_sum-0" and row["messages"] is None and row["prompt"] and row["answer"]
    entry = row["metadata"]["reasoning_gym"]["entry"]
    assert (entry["question"], entry["answer"]) == (row["prompt"], row["answer"])
    assert reasoning_gym.score(row["answer"], row) == 1.0 and is_correct(f"<answer>{row['answer']}</answer>", row)
    assert reasoning_gym.score("no idea", row) == 0.0 and not is_correct("no idea", row)
    with pytest.raises(ValueError, match="data.dataset 'no_such_gym'"):
        reasoning_gym.generate_rows("no_such_gym", {}, 2, seed=0)
    with pytest.raises(ValueError, match="data.dataset 'chain_sum' with data.dataset_config"):
        reasoning_gym.generate_rows("chain_sum", {"min_terms": "many"}, 2, seed=0)


def test_reward_kind_uses_the_generators_scorer() -> None:
    from gpu_runtime.store.artifacts import Sample

    rows = reasoning_gym.generate_rows("basic_arithmetic", {}, 2, seed=1)
    responses = [rows[0]["answer"], f"thinking... <answer>{rows[1]['answer']}</answer>", "7 or so"]
    samples = [Sample(sample_id=f"s1-p{i}-g0", prompt_index=i, group_index=0, prompt_ids=[1], response_ids=[2],
                      logprobs=[0.0], weight_version=0, finish_reason="stop", prompt_text=rows[i % 2]["prompt"],
                      response_text=text) for i, text in enumerate(responses)]
    spec = RewardSpec(kind="reasoning_gym")
    got = score_samples(samples, {0: rows[0], 1: rows[1], 2: rows[0]}, spec)
    assert [(r.reward, r.correct) for r in got[:2]] == [(1.0, True), (1.0, True)]
    assert got[2].correct is False and got[2].reward < 1.0


def test_a_hung_generator_scorer_is_killed_and_scores_zero(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The generator's scorer runs in the reward sandbox with reward.timeout_s per call: a
    scorer that never returns (stood in by tests.reward_fns.hanging_reward, which hangs on
    the response "67"; the child process and its kill are real) scores 0 with an error, and
    the next sample is scored by a fresh child with the generator's own scorer."""
    from gpu_runtime.data.rewards import scoring
    from gpu_runtime.data.rewards.scoring import ScoreStats
    from gpu_runtime.store.artifacts import Sample

    rows = reasoning_gym.generate_rows("basic_arithmetic", {}, 1, seed=1)
    monkeypatch.setenv("MILESTONE_TEST_PID_FILE", str(tmp_path / "pid"))
    calls = iter(["tests.reward_fns:hanging_reward", scoring.REASONING_GYM_FN])
    real_call = scoring.RewardSandbox.call
    monkeypatch.setattr(scoring.RewardSandbox, "call", lambda self, path, args, timeout_s: real_call(
        self, next(calls), args, timeout_s))
    samples = [Sample(sample_id=f"s1-p0-g{i}", prompt_index=0, group_index=i, prompt_ids=[1], response_ids=[2],
                      logprobs=[0.0], weight_version=0, finish_reason="stop", prompt_text=rows[0]["prompt"],
                      response_text=text) for i, text in enumerate(["67", rows[0]["answer"]])]
    stats = ScoreStats()
    got = score_samples(samples, {0: rows[0]}, RewardSpec(kind="reasoning_gym", timeout_s=1.0),
                        stats=stats)
    assert (got[0].reward, got[0].correct) == (0.0, False)
    assert "timed out after 1 s (its process was killed)" in got[0].error
    assert (got[1].reward, got[1].correct, got[1].error) == (1.0, True, "")
    assert (stats.errors, stats.sandbox_kills) == (1, 1)


def test_prepare_data_writes_train_and_disjoint_eval_rows(tmp_path: Path) -> None:
    data = DataSpec(kind="reasoning_gym", dataset="chain_sum", dataset_config=CHAIN, num_train=40)
    inp = PrepareDataInput(run_id="rg", store_uri=f"file://{tmp_path}", seed=5, data=data, reward=RewardSpec(
        kind="reasoning_gym"), eval=EvalSpec(n=6))
    info = ActivityEnvironment().run(prepare_data, inp)
    assert info.n_rows == 40 and info.eval_key is not None and info.n_eval == 6
    train = load_jsonl(tmp_path / info.key)
    held = load_jsonl(tmp_path / info.eval_key)
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in held)
    assert all(r["id"].startswith("rg-chain_sum-eval-") for r in held)
    before = (tmp_path / info.key).read_bytes()
    assert ActivityEnvironment().run(prepare_data, inp) == info and (tmp_path / info.key).read_bytes() == before

    bad = inp.model_copy(update={"run_id": "rg-bad", "data": data.model_copy(update={"dataset": "no_such_gym"})})
    with pytest.raises(ApplicationError) as err:
        ActivityEnvironment().run(prepare_data, bad)
    assert err.value.type == Failure.INVALID_INPUT.value and "data.dataset 'no_such_gym'" in str(err.value)
    assert not (tmp_path / art.dataset_key("rg-bad", "train")).exists()
    assert json.loads((tmp_path / info.key).read_text().splitlines()[0])["metadata"]["reasoning_gym"]["dataset"] == "chain_sum"


def test_config() -> None:
    cfg = RunConfig.model_validate({"data": {"kind": "reasoning_gym", "dataset": "chain_sum", "num_train": 100},
                                    "reward": {"kind": "reasoning_gym"}})
    assert cfg.data.dataset == "chain_sum" and cfg.data.dataset_config == {}
    bad = [
        ({"data": {"kind": "reasoning_gym"}}, "dataset .* is required"),
        ({"data": {"kind": "reasoning_gym", "dataset": "x", "path": "a.jsonl"}}, "path / eval_path"),
        ({"data": {"dataset": "chain_sum"}}, "apply to kind reasoning_gym"),
        ({"reward": {"kind": "reasoning_gym"}}, "scores rows of data.kind reasoning_gym"),
    ]
    for raw, needle in bad:
        with pytest.raises(ValidationError, match=needle):
            RunConfig.model_validate(raw)
