"""Answer extraction, the math rule, and custom reward functions by dotted path."""

from __future__ import annotations

import threading

import pytest
from pydantic import ValidationError

from gpu_runtime.store.artifacts import Sample
from activities.translate import reward_settings
from gpu_runtime.data.rewards import (
    RewardError, RewardFunctionNotFound, RewardSettings, extract_answer, load_reward_function, math_answer_reward,
    score_samples,
)
from workflows.config import RewardSpec
from tests.engine_fixtures import _tokenizer

ROW = {"id": "r0", "prompt": "23+45=", "messages": None, "answer": "23+45=68\n#### 68", "metadata": {}}
_RELEASE = threading.Event()


def length_reward(prompt: str, response: str, row: dict) -> float:
    return float(len(response)) + (0.5 if prompt.endswith("=") else 0.0)


def failing_reward(prompt: str, response: str, row: dict) -> float:
    raise KeyError("boom")


def string_reward(prompt: str, response: str, row: dict) -> float:
    return "1"  # type: ignore[return-value]


NOT_CALLABLE = 3


def blocking_reward(prompt: str, response: str, row: dict) -> float:
    _RELEASE.wait(10.0)
    return 1.0


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
    assert math_answer_reward("", ROW) == (0.0, False)


@pytest.mark.parametrize("label", ["Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", "72", " 072\n", "#### 72"])
def test_math_answer_reads_gsm8k_and_integer_labels(label: str) -> None:
    row = {**ROW, "answer": label}
    assert math_answer_reward("so 72 in total", row) == (1.0, True)
    assert math_answer_reward("#### 71", row) == (0.0, False)


def test_math_answer_on_a_label_without_an_integer_names_the_row() -> None:
    with pytest.raises(ValueError, match="row 'r0': field 'answer' has no integer answer"):
        math_answer_reward("72", {**ROW, "answer": "seventy-two"})


def test_reward_spec_validation() -> None:
    assert RewardSpec().kind == "math_answer"
    with pytest.raises(ValidationError, match="function is required when kind is 'custom'"):
        RewardSpec(kind="custom")
    with pytest.raises(ValidationError, match="must look like 'pkg.module:fn'"):
        RewardSpec(kind="custom", function="not a path")
    with pytest.raises(ValidationError):
        RewardSpec(timeout_s=0)


def settings(**kw: object) -> RewardSettings:
    """The run config's ``reward`` section as the control worker hands it to the scorer."""
    return reward_settings(RewardSpec(**kw))


def _samples() -> list[Sample]:
    """Samples as the rollout stores them: ids, and their text decoded by the model's tokenizer."""
    tok = _tokenizer()
    p = tok.encode("23+45=")
    out = []
    for g, text in enumerate(["68", "67", "6"]):
        r = tok.encode(text) + [tok.eos_token_id]
        out.append(Sample(sample_id=f"s0-p0-g{g}", prompt_index=0, group_index=g, prompt_ids=p, response_ids=r,
                          logprobs=[0.0] * len(r), weight_version=0, finish_reason="stop",
                          prompt_text="23+45=", response_text=tok.decode(r)))
    return out


def test_score_samples_math() -> None:
    res = score_samples(_samples(), [ROW], settings())
    assert [r.reward for r in res] == [1.0, 0.0, 0.0]
    assert [r.correct for r in res] == [True, False, False]
    assert res[0].sample_id == "s0-p0-g0"


@pytest.mark.parametrize("sep", [":", "."])
def test_score_samples_custom_by_dotted_path(sep: str) -> None:
    spec = settings(kind="custom", function=f"{__name__}{sep}length_reward")
    res = score_samples(_samples(), {0: ROW}, spec)
    assert [r.reward for r in res] == [2.5, 2.5, 1.5]
    assert [r.correct for r in res] == [True, False, False]


def row_echo_reward(prompt: str, response: str, row: dict) -> float:
    """Sees the normalized row: messages, answer and metadata."""
    assert row["messages"] == [{"role": "user", "content": "23+45?"}] and row["prompt"] is None
    return float(row["metadata"]["weight"]) * (response == row["answer"])


def test_custom_reward_gets_the_normalized_row_with_a_text_label() -> None:
    row = {"id": "c0", "prompt": None, "messages": [{"role": "user", "content": "23+45?"}], "answer": "6",
           "metadata": {"weight": 2}}
    res = score_samples(_samples(), [row], settings(kind="custom", function=f"{__name__}:row_echo_reward"))
    assert [r.reward for r in res] == [0.0, 0.0, 2.0]
    assert [r.correct for r in res] == [False, False, True]  # "6" is an integer label: the math rule decides
    res = score_samples(_samples(), [{**row, "answer": "six"}],
                        settings(kind="custom", function=f"{__name__}:row_echo_reward"))
    assert [r.correct for r in res] == [False, False, False]  # no integer label: correct = reward > 0


def test_custom_errors_name_the_function() -> None:
    with pytest.raises(RewardError, match="failing_reward.*KeyError"):
        score_samples(_samples(), [ROW], settings(kind="custom", function=f"{__name__}:failing_reward"))
    with pytest.raises(RewardError, match="string_reward.*expected float"):
        score_samples(_samples(), [ROW], settings(kind="custom", function=f"{__name__}:string_reward"))
    with pytest.raises(RewardError, match="no_such_module"):
        load_reward_function("no_such_module:fn")
    with pytest.raises(RewardError, match="no callable 'missing'"):
        load_reward_function(f"{__name__}:missing")


def test_custom_timeout() -> None:
    spec = settings(kind="custom", function=f"{__name__}:blocking_reward", timeout_s=0.05)
    try:
        with pytest.raises(RewardError, match="blocking_reward.*timed out after 0.05 s"):
            score_samples(_samples(), [ROW], spec)
    finally:
        _RELEASE.set()


def test_unknown_prompt_index() -> None:
    with pytest.raises(ValueError, match="prompt_index 0 not in dataset"):
        score_samples(_samples(), {}, settings())


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
        (f"{__name__}:missing", "has no callable 'missing'"),
        (f"{__name__}:NOT_CALLABLE", f"{__name__}.NOT_CALLABLE is not callable \\(int\\)"),
        ("not a path", "cannot import module ''"),  # the run config refuses this shape first
    ],
)
def test_function_not_found_is_its_own_type(path: str, needle: str) -> None:
    """What cannot be loaded is deterministic (RewardFunctionNotFound, still a RewardError)."""
    with pytest.raises(RewardFunctionNotFound, match=needle):
        load_reward_function(path)


def test_function_that_raises_is_not_a_not_found() -> None:
    spec = settings(kind="custom", function=f"{__name__}:failing_reward")
    with pytest.raises(RewardError) as err:
        score_samples(_samples(), [ROW], spec)
    assert not isinstance(err.value, RewardFunctionNotFound)
