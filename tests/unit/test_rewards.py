"""Reward kinds against hand-written values: the integer rule, GSM8K strict / flexible,
format regex, weighted sums, math-verify, and custom functions by dotted path in their
killable child process (timeouts, error policies). The endpoints are in test_reward_endpoints.py."""

from __future__ import annotations

from pathlib import Path

import math_verify  # noqa: F401  (a dev dependency: imported, so a broken install fails loudly)
import pytest
from pydantic import ValidationError

from gpu_runtime.data.rewards import (
    RewardFatal,
    RewardFunctionNotFound,
    ScoreStats,
    extract_answer,
    load_reward_function,
    math_answer_reward,
    mathverify,
    score_samples,
    scoring,
)
from gpu_runtime.data.rewards.rules import format_reward, gsm8k_extract, gsm8k_label, gsm8k_reward, normalize_number
from gpu_runtime.proc.processes import pid_alive
from gpu_runtime.store.artifacts import Sample
from spec.reward import RewardSpec
from tests.stack import wait_for

ROW = {"id": "r0", "prompt": "23+45=", "messages": None, "answer": "23+45=68\n#### 68", "metadata": {}}


FNS = "tests.reward_fns"  # the functions the tests load by dotted path (in the reward child process)


def settings(**kw: object) -> RewardSpec:
    """The run config's ``reward`` section as the control worker hands it to the scorer."""
    return RewardSpec(**kw)


def samples(texts: list[str], prompt: str = "23+45=") -> list[Sample]:
    return [Sample(sample_id=f"s0-p0-g{g}", prompt_index=0, group_index=g, prompt_ids=[1], response_ids=[2, 3],
                   logprobs=[0.0, 0.0], weight_version=0, finish_reason="stop", prompt_text=prompt,
                   response_text=text)
            for g, text in enumerate(texts)]


# ---- math_answer ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "expected"),
    [("68", "68"), ("the answer is 68", "68"), ("23+45=68\n#### 68", "68"), ("#### 68 then 99", "68"),
     ("1 2 3", "3"), ("-7", "-7"), ("007", "7"), ("no digits", None), ("", None)],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_math_answer_reward() -> None:
    assert math_answer_reward("68", ROW) == (1.0, True)
    assert math_answer_reward("23+45=68\n#### 68", ROW) == (1.0, True)
    assert math_answer_reward("67", ROW) == (0.0, False)
    with pytest.raises(ValueError, match="row 'r0': field 'answer' has no integer answer"):
        math_answer_reward("72", {**ROW, "answer": "seventy-two"})


def test_score_samples_math() -> None:
    res = score_samples(samples(["68", "67", "6"]), [ROW], settings())
    assert [(r.reward, r.correct, r.terms) for r in res] == [(1.0, True, {}), (0.0, False, {}), (0.0, False, {})]
    assert res[0].sample_id == "s0-p0-g0" and res[1].detail == "answer='67' expected='68'"


def test_unknown_prompt_index() -> None:
    with pytest.raises(ValueError, match="prompt_index 0 not in dataset"):
        score_samples(samples(["68"]), {}, settings())


def test_a_label_the_rule_cannot_read_is_fatal() -> None:
    with pytest.raises(RewardFatal, match="reward.kind math_answer: row 'r0'"):
        score_samples(samples(["68"]), [{**ROW, "answer": "n/a"}], settings())


# ---- gsm8k ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("token", "expected"), [
    ("72", "72"), ("1,234", "1234"), ("$5", "5"), ("72.0", "72"), ("72.", "72"), ("0.50", "0.5"), ("-3", "-3"),
    ("$1,000.00", "1000"), ("-0", "0"), ("1.25", "1.25"), ("abc", None),
])
def test_normalize_number(token: str, expected: str | None) -> None:
    assert normalize_number(token) == expected


@pytest.mark.parametrize(("text", "strict", "flexible"), [
    ("Natalia sold 48 clips.\n#### 72", "72", "72"),
    ("#### 1,234 apples", "1234", "1234"),
    ("It costs $5.00 so\n#### $5.00", "5", "5"),
    ("#### 72.0", "72", "72"),
    ("####72", "72", "72"),  # no space after the marker: still the answer
    ("#### 72 and later #### 73", "72", "73"),  # strict takes the first marker, flexible the last number
    ("the answer is 72", None, "72"),  # no marker: strict finds nothing
    ("so 1,000 apples. Then 72.", None, "72"),
    ("3.50 dollars", None, "3.5"),
    ("#### -3", "-3", "-3"),
    ("no number here", None, None),
    ("####", None, None),
])
def test_gsm8k_extract(text: str, strict: str | None, flexible: str | None) -> None:
    assert gsm8k_extract(text, "strict") == strict
    assert gsm8k_extract(text, "flexible") == flexible


@pytest.mark.parametrize(("label", "expected"), [
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"), ("#### 1,000", "1000"), ("72", "72"),
    ("3.5", "3.5"), ("#### $18.00", "18"),
])
def test_gsm8k_label(label: str, expected: str) -> None:
    assert gsm8k_label({"id": "g", "answer": label}) == expected


def test_gsm8k_reward_and_format_score() -> None:
    row = {"id": "g1", "answer": "... so 70 + 2 = 72\n#### 72"}
    assert gsm8k_reward("#### 72", row, "strict", 0.0) == (1.0, True, "72")
    assert gsm8k_reward("#### 71", row, "strict", 0.1) == (0.1, False, "71")  # found but wrong: format_score
    assert gsm8k_reward("72", row, "strict", 0.1) == (0.0, False, None)  # strict: no '####', no credit at all
    assert gsm8k_reward("72", row, "flexible", 0.1) == (1.0, True, "72")
    with pytest.raises(ValueError, match="row 'g2': field 'answer' has no number for reward.kind gsm8k"):
        gsm8k_label({"id": "g2", "answer": "#### many"})


def test_score_samples_gsm8k() -> None:
    row = {**ROW, "answer": "#### 1,068"}
    res = score_samples(samples(["so #### 1068", "#### 1,068.0", "#### 7", "1068"]), [row],
                        settings(kind="gsm8k", format_score=0.25))
    assert [r.reward for r in res] == [1.0, 1.0, 0.25, 0.0]
    assert [r.correct for r in res] == [True, True, False, False]
    flexible = score_samples(samples(["it is 1068", "#### 7"]), [row], settings(kind="gsm8k", mode="flexible"))
    assert [r.reward for r in flexible] == [1.0, 0.0]


# ---- format and weighted -------------------------------------------------------------------
THINK = r"<think>.*?</think>\s*\d+"


@pytest.mark.parametrize(("text", "expected"), [
    ("<think>23+45\nis 68</think> 68", 1.0),  # '.' matches newlines
    ("<think>x</think>68", 1.0),
    ("68", 0.0),
    ("say <think>x</think> 68", 0.0),  # the whole response must match
    ("<think>x</think> 68 more", 0.0),
])
def test_format_reward(text: str, expected: float) -> None:
    assert format_reward(text, THINK, 1.0) == expected


def test_weighted_sum_records_each_term() -> None:
    spec = settings(kind="weighted", terms=[
        {"kind": "math_answer", "weight": 0.9},
        {"kind": "format", "pattern": THINK, "weight": 0.1, "format_score": 2.0},
    ])
    res = score_samples(samples(["<think>a</think> 68", "68", "<think>a</think> 67", "x"]), [ROW], spec)
    assert [r.reward for r in res] == pytest.approx([0.9 + 0.2, 0.9, 0.2, 0.0])
    assert [r.terms for r in res] == [{"math_answer": 1.0, "format": 2.0}, {"math_answer": 1.0, "format": 0.0},
                                      {"math_answer": 0.0, "format": 2.0}, {"math_answer": 0.0, "format": 0.0}]
    assert [r.correct for r in res] == [True, True, False, False]  # the answer term decides, not the format
    assert res[0].detail == "math_answer: answer='68' expected='68'; format: format match"


def test_format_only_correct_falls_back_to_the_math_rule() -> None:
    res = score_samples(samples(["<think>a</think> 68", "<think>a</think> 1"]), [ROW],
                        settings(kind="format", pattern=THINK))
    assert [(r.reward, r.correct) for r in res] == [(1.0, True), (1.0, False)]


def test_reward_spec_validation_names_the_field() -> None:
    assert RewardSpec().kind == "math_answer"
    cases = [
        (dict(kind="custom"), "function is required when kind is 'custom'"),
        (dict(kind="custom", function="not a path"), "must look like 'pkg.module:fn'"),
        (dict(timeout_s=0), "timeout_s"),
        (dict(kind="format"), "pattern\n  Value error, required when kind is 'format'"),
        (dict(kind="format", pattern="(<think>"), "pattern\n  Value error, invalid regular expression"),
        (dict(kind="gsm8k", pattern="x"), "pattern\n  Value error, applies to kind format, not 'gsm8k'"),
        (dict(kind="gsm8k", mode="loose"), "mode\n  Input should be 'strict' or 'flexible'"),
        (dict(kind="http"), "url\n  Value error, required when kind is 'http'"),
        (dict(kind="judge", url="localhost:8000"), "must start with http:// or https://"),
        (dict(kind="http", url="http://x", batch_size=0), "batch_size\n  Input should be greater than or equal to 1"),
        (dict(kind="math_answer", error_policy="zero"), "error_policy\n  Value error, applies to kind custom"),
        (dict(kind="weighted"), "terms\n  Value error, required when kind is 'weighted'"),
        (dict(kind="weighted", terms=[{"kind": "weighted"}]), "terms.0.kind\n  Value error, a term of a weighted"),
        (dict(kind="weighted", terms=[{"kind": "format", "pattern": "a"}, {"kind": "format", "pattern": "b"}]),
         "term names must be unique, ['format'] repeat"),
        (dict(kind="math_answer", terms=[{"kind": "gsm8k"}]), "terms\n  Value error, applies to kind weighted"),
        (dict(kind="nope"), "kind\n  Input should be 'math_answer', 'math_verify', 'gsm8k'"),
    ]
    for kw, needle in cases:
        with pytest.raises(ValidationError) as err:
            RewardSpec(**kw)
        assert needle in str(err.value), (kw, str(err.value))
    RewardSpec(kind="weighted", terms=[{"kind": "format", "pattern": "a"}, {"kind": "format", "pattern": "b", "name": "f2"}])


def test_an_older_stored_reward_section_still_reads() -> None:
    """What runs recorded before the new kinds serialized: kind, function, timeout_s."""
    old = {"kind": "custom", "function": "m:f", "timeout_s": 3.0}
    assert RewardSpec.model_validate(old).resolved()["error_policy"] == "fail"
    assert RewardSpec.model_validate({"kind": "math_answer", "function": None, "timeout_s": 10.0}).kind == "math_answer"
    new = RewardSpec(kind="gsm8k", mode="flexible")
    assert RewardSpec.model_validate(new.model_dump()) == new  # a dump of every field reads back


# ---- custom functions in the reward process -------------------------------------------------
@pytest.mark.parametrize("sep", [":", "."])
def test_custom_reward_by_dotted_path(sep: str) -> None:
    res = score_samples(samples(["68", "67", "6"]), {0: ROW}, settings(kind="custom", function=f"{FNS}{sep}length_reward"))
    assert [r.reward for r in res] == [2.5, 2.5, 1.5]
    assert [r.correct for r in res] == [True, False, False]  # an integer label: the math rule decides


def test_custom_reward_gets_the_normalized_row() -> None:
    row = {"id": "c0", "prompt": None, "messages": [{"role": "user", "content": "23+45?"}], "answer": "6",
           "metadata": {"weight": 2}}
    fn = settings(kind="custom", function=f"{FNS}:row_echo_reward")
    assert [(r.reward, r.correct) for r in score_samples(samples(["68", "67", "6"]), [row], fn)] == [
        (0.0, False), (0.0, False), (2.0, True)]
    res = score_samples(samples(["68", "6"]), [{**row, "answer": "six"}], fn)
    assert [r.correct for r in res] == [False, False]  # no integer label: correct = reward > 0


def test_prints_of_a_custom_function_do_not_break_the_reply() -> None:
    res = score_samples(samples(["68"]), [ROW], settings(kind="custom", function=f"{FNS}:chatty_reward"))
    assert res[0].reward == 2.0


@pytest.mark.parametrize(("fn", "needle"), [
    ("failing_reward", "raised KeyError: 'boom'"),
    ("string_reward", "returned str, expected float"),
    ("nan_reward", "returned non-finite value nan"),
])
def test_custom_errors_name_the_function_and_the_sample(fn: str, needle: str) -> None:
    path = f"{FNS}:{fn}"
    with pytest.raises(RewardFatal) as err:
        score_samples(samples(["68", "67"]), [ROW], settings(kind="custom", function=path))
    assert f"reward function '{path}' on sample s0-p0-g0 {needle} (error_policy fail)" == str(err.value)
    stats = ScoreStats()
    res = score_samples(samples(["68", "67"]), [ROW], settings(kind="custom", function=path, error_policy="zero"),
                        stats=stats)
    assert [r.reward for r in res] == [0.0, 0.0] and stats.errors == 2
    assert needle in res[0].error and res[0].correct is True  # the math rule still says which answer is right


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
        (f"{FNS}:missing", "has no callable 'missing'"),
        (f"{FNS}:NOT_CALLABLE", f"{FNS}.NOT_CALLABLE is not callable \\(int\\)"),
        ("not a path", "cannot import module ''"),  # the run config refuses this shape first
    ],
)
def test_function_not_found_is_its_own_type(path: str, needle: str) -> None:
    """What cannot be loaded is deterministic (RewardFunctionNotFound), in this process and in the child."""
    with pytest.raises(RewardFunctionNotFound, match=needle):
        load_reward_function(path)
    with pytest.raises(RewardFunctionNotFound, match=needle):
        score_samples(samples(["68"]), [ROW], settings(kind="custom", function="m:f").model_copy(update={"function": path}))


@pytest.fixture
def pid_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    path = tmp_path / "hung.pid"
    monkeypatch.setenv("MILESTONE_TEST_PID_FILE", str(path))
    return path


def test_a_hung_function_is_killed_and_the_pass_goes_on(pid_file: Path) -> None:
    """error_policy zero: the hung call scores 0, its process is killed, and the next sample
    is scored by a fresh process."""
    stats = ScoreStats()
    spec = settings(kind="custom", function=f"{FNS}:hanging_reward", timeout_s=1.0, error_policy="zero")
    res = score_samples(samples(["68", "67", "6"]), [ROW], spec, stats=stats)
    assert [r.reward for r in res] == [1.0, 0.0, 1.0]
    assert "timed out after 1 s (its process was killed)" in res[1].error
    assert (stats.errors, stats.sandbox_kills) == (1, 1)
    hung = int(pid_file.read_text())
    wait_for(lambda: not pid_alive(hung), 10, what=f"hung reward process {hung} gone")


def test_a_hung_function_fails_the_pass_under_error_policy_fail(pid_file: Path) -> None:
    spec = settings(kind="custom", function=f"{FNS}:hanging_reward", timeout_s=1.0)
    with pytest.raises(RewardFatal, match="on sample s0-p0-g1 timed out after 1 s"):
        score_samples(samples(["68", "67"]), [ROW], spec)
    hung = int(pid_file.read_text())
    wait_for(lambda: not pid_alive(hung), 10, what=f"hung reward process {hung} gone")


# ---- math_verify ---------------------------------------------------------------------------
def test_math_verify() -> None:
    rows = [{**ROW, "answer": "#### 72"}, {**ROW, "answer": "\\frac{1}{2}"}]
    items = samples(["The answer is $72$.", "\\boxed{71}", "so \\boxed{0.5}", "it is 1/3"])
    items[2] = items[2].model_copy(update={"prompt_index": 1})
    items[3] = items[3].model_copy(update={"prompt_index": 1})
    res = score_samples(items, rows, settings(kind="math_verify"))
    assert [(r.reward, r.correct) for r in res] == [(1.0, True), (0.0, False), (1.0, True), (0.0, False)]


def test_math_verify_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mathverify, "available", lambda: False)
    with pytest.raises(RewardFatal, match="reward.kind: math_verify needs the math-verify package"):
        score_samples(samples(["72"]), [ROW], settings(kind="math_verify"))
    assert scoring.MATH_VERIFY_FN.endswith(":math_verify_reward")


def test_rewards_stored_before_the_terms_field_still_load() -> None:
    from gpu_runtime.store.artifacts import SampleReward, StepRewards

    old = '{"run_id": "r", "step": 3, "rewards": [{"sample_id": "s3-p0-g0", "reward": 1.0, "correct": true, "detail": ""}]}'
    (r,) = StepRewards.model_validate_json(old).rewards
    assert (r.terms, r.error) == ({}, "") and isinstance(r, SampleReward)
