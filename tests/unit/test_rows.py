"""The normalized row schema and the functions that read rows."""

from __future__ import annotations

from datetime import datetime

import pytest
from pydantic import ValidationError

from gpu_runtime.data.rows import DataRow, final_answer, int_answer, prompt_messages, prompt_text, sft_target

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


def row(**kw: object) -> dict:
    base: dict = {"id": "r", "prompt": "Tom has 3 apples and buys 2. How many?", "messages": None,
                  "answer": "3+2=5\n#### 5", "metadata": {}}
    return {**base, **kw}


@pytest.mark.parametrize(
    ("label", "expected"),
    [("x\n#### 72", "72"), ("#### -3", "-3"), ("a #### 1 then\n#### 007 ", "7"), ("72", "72"), (" -5\n", "-5"),
     ("#### 1.5", None), ("#### 72 apples", None), ("3 + 4", None), ("seventy", None), ("", None), ("####", None)],
)
def test_int_answer(label: str, expected: str | None) -> None:
    assert int_answer(label) == expected


def test_final_answer_error_names_the_row_id() -> None:
    assert final_answer(row(answer="42")) == "42"
    with pytest.raises(ValueError, match=r"row 'g7': field 'answer' has no integer answer .* got 'about 5'"):
        final_answer(row(id="g7", answer="about 5"))


def test_plain_prompt_row_is_fed_verbatim_and_learns_its_full_label() -> None:
    r = row()
    assert prompt_text(r) == "Tom has 3 apples and buys 2. How many?"
    assert sft_target(r) == "3+2=5\n#### 5"
    assert prompt_messages(r) is None


def test_arithmetic_prompt_learns_the_bare_answer() -> None:
    assert sft_target(row(prompt="23+45=", answer="23+45=68\n#### 68")) == "68"
    assert sft_target(row(prompt="Compute 23+45=", answer="23+45=68\n#### 68")) == "23+45=68\n#### 68"


def test_messages_row_exposes_the_chat_and_has_no_prompt_text() -> None:
    r = DataRow.model_validate(row(id="c1", prompt=None, messages=CHAT)).model_dump()
    assert prompt_messages(r) == CHAT
    with pytest.raises(ValueError, match="row 'c1' is a messages row: .*chat template"):
        prompt_text(r)
    assert sft_target(r) == "3+2=5\n#### 5"


def test_message_null_extras_are_dropped_other_extras_refused() -> None:
    padded = [{"role": "user", "content": "hi", "tool_calls": None}]
    assert DataRow.model_validate(row(prompt=None, messages=padded)).model_dump()["messages"] == [
        {"role": "user", "content": "hi"}
    ]
    with pytest.raises(ValidationError, match="messages.0.name"):
        DataRow.model_validate(row(prompt=None, messages=[{"role": "user", "content": "hi", "name": "bob"}]))


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"messages": CHAT}, "exactly one of 'prompt' and 'messages'"),
        ({"prompt": None}, "exactly one of 'prompt' and 'messages'"),
        ({"prompt": "  \n"}, "prompt\n  Value error, must not be empty"),
        ({"prompt": None, "messages": []}, "must hold at least one message"),
        ({"prompt": None, "messages": [{"role": "user", "content": " "}]}, "every message's content is empty"),
        ({"prompt": None, "messages": [{"role": "", "content": "x"}]}, "messages.0.role"),
        ({"answer": 5}, "answer\n  Input should be a valid string"),
        ({"id": ""}, "id\n  String should have at least 1 character"),
        ({"metadata": {"ts": datetime(2020, 1, 1)}}, "'ts': a datetime is not a JSON value"),
        ({"question": "q"}, "question\n  Extra inputs are not permitted"),
    ],
)
def test_data_row_rejects(kw: dict, needle: str) -> None:
    with pytest.raises(ValidationError) as err:
        DataRow.model_validate(row(**kw))
    assert needle in str(err.value)
