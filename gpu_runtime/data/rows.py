"""The normalized dataset row: what every reader produces, what ``prepare_data``
writes to the run's dataset in the store, and what every consumer reads.

A row is a plain dict of this shape (``DataRow.model_dump()``)::

    {"id": "gsm8k-17", "prompt": "Tom has 3 apples...", "messages": None,
     "answer": "3+2=5\\n#### 5", "metadata": {"source": "gsm8k"}}

Exactly one of ``prompt`` (plain text, fed to the model as it is) and
``messages`` (a chat, ``[{"role": ..., "content": ...}, ...]``, rendered by the
model's chat template on the tokenizer side) is set. ``answer`` is the label as
a string. ``metadata`` holds any JSON values copied from the source
(``data.metadata_keys``). Custom reward functions receive this dict as ``row``.

Torch-free and I/O-free.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# the prompt of a built-in arithmetic row ("23+45="): its SFT target is the bare final answer
ARITHMETIC_PROMPT = re.compile(r"-?\d+[+\-*]-?\d+=")
_INT = re.compile(r"\s*(-?\d+)\s*")


class Message(BaseModel):
    """One chat turn. Only ``role`` and ``content`` are kept; other keys are an
    error unless null (Parquet struct columns pad absent fields with null)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: str = Field(min_length=1, description="system, user, assistant, ...: passed to the chat template as is")
    content: str = Field(description="the turn's text")

    @model_validator(mode="before")
    @classmethod
    def _drop_null_extras(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: v for k, v in value.items() if k in ("role", "content") or v is not None}
        return value


class DataRow(BaseModel):
    """One normalized row; ``model_dump()`` is the dict every consumer reads."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str = Field(min_length=1, description="unique within the dataset")
    prompt: str | None = Field(None, description="plain-text prompt, fed to the model verbatim")
    messages: list[Message] | None = Field(None, description="chat prompt, rendered by the model's chat template")
    answer: str = Field(description="the label, as a string (GSM8K style '... #### 72' or just '72')")
    metadata: dict[str, Any] = Field(default_factory=dict, description="JSON values copied from the source")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[Message] | None) -> list[Message] | None:
        if v is not None:
            if not v:
                raise ValueError("must hold at least one message")
            if not any(m.content.strip() for m in v):
                raise ValueError("every message's content is empty")
        return v

    @field_validator("metadata")
    @classmethod
    def _json_values(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key, value in v.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise ValueError(f"{key!r}: a {type(value).__name__} is not a JSON value") from None
        return v

    @model_validator(mode="after")
    def _one_prompt(self) -> DataRow:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' and 'messages' must be set")
        return self


def int_answer(label: str) -> str | None:
    """The integer after the last ``####`` (GSM8K), else the whole label when it
    is an integer; normalised (``"007"`` -> ``"7"``). ``None`` when there is none
    (text after ``####`` that is not an integer does not fall back to the label)."""
    _, sep, tail = label.rpartition("####")
    m = _INT.fullmatch(tail if sep else label)
    return str(int(m.group(1))) if m else None


def final_answer(row: Mapping[str, Any]) -> str:
    """The row's integer answer for the math check; ValueError naming the row id when it has none."""
    label = row.get("answer")
    got = int_answer(label) if isinstance(label, str) else None
    if got is None:
        raise ValueError(
            f"row {row.get('id')!r}: field 'answer' has no integer answer (expected '#### <integer>' "
            f"at the end, or an integer), got {label!r}"
        )
    return got


def prompt_text(row: Mapping[str, Any]) -> str:
    """The plain-text prompt (``"23+45="`` for the built-in arithmetic rows).
    A messages row has none: the tokenizer renders ``prompt_messages(row)``."""
    if row.get("messages") is not None:
        raise ValueError(
            f"row {row.get('id')!r} is a messages row: its prompt is rendered by the model's chat template "
            "from prompt_messages(row), not by prompt_text"
        )
    prompt = row.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError(f"row {row.get('id')!r}: field 'prompt' is missing (not a normalized row?)")
    return prompt


def prompt_messages(row: Mapping[str, Any]) -> list[dict[str, str]] | None:
    """The chat of a messages row, unchanged; ``None`` for a plain-prompt row."""
    return row.get("messages")


def sft_target(row: Mapping[str, Any]) -> str:
    """The SFT completion (EOS goes right after it): the row's ``metadata.sft_target`` when it
    has one (a demonstration, e.g. of a tool-calling episode), the bare final answer for a
    built-in arithmetic row (prompt ``"A<op>B="``), the full label otherwise."""
    demo = (row.get("metadata") or {}).get("sft_target")
    if isinstance(demo, str) and demo:
        return demo
    prompt = row.get("prompt")
    if isinstance(prompt, str) and ARITHMETIC_PROMPT.fullmatch(prompt):
        return final_answer(row)
    return str(row["answer"])


def opening_chat(row: Mapping[str, Any]) -> list[dict[str, str]]:
    """An agent episode's opening chat: a messages row as it is, a plain prompt as one user message."""
    return prompt_messages(row) or [{"role": "user", "content": prompt_text(row)}]
