"""The ``data`` section of the run config: where a run's prompts come from (torch-free)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from spec.strict import Strict

_DATA_SUFFIXES = {"jsonl": (".jsonl", ".ndjson", ".json"), "parquet": (".parquet", ".pq")}


class DataSpec(Strict):
    """``arithmetic`` generates rows offline from the run seed; ``jsonl`` / ``parquet``
    read ``path`` and map its keys onto the normalized row (``gpu_runtime.data.rows``).
    The prompt comes from ``messages_key`` when it is set (a chat), else from
    ``prompt_key``: ``messages_key`` wins, ``prompt_key`` is then unused."""

    kind: Literal["arithmetic", "tool_arithmetic", "jsonl", "parquet", "reasoning_gym"] = Field(
        "arithmetic",
        description="arithmetic / tool_arithmetic / reasoning_gym: generated offline at data preparation "
        "(tool_arithmetic: chat rows for rollout.agent with the calculator); jsonl / parquet: read from path",
    )
    path: str | None = Field(
        None, description="the dataset file (required for jsonl / parquet; suffix .jsonl/.ndjson/.json or .parquet/.pq)"
    )
    num_train: int = Field(2000, ge=1, description="rows to generate (arithmetic, reasoning_gym)")
    dataset: str | None = Field(
        None, min_length=1, description="reasoning_gym: the generator's name (e.g. chain_sum, basic_arithmetic)"
    )
    dataset_config: dict[str, Any] = Field(
        default_factory=dict, description="reasoning_gym: the generator's own settings (e.g. {min_terms: 2})"
    )
    min_operand: int = Field(0, ge=0, description="operands are drawn from min_operand..max_operand (arithmetic, tool_arithmetic)")
    max_operand: int = Field(99, ge=1, description="operands are drawn from min_operand..max_operand (arithmetic, tool_arithmetic)")
    ops: str = Field("+", description="operators to draw from, any of +-* (arithmetic, tool_arithmetic)")
    chat: bool = Field(
        False, description="arithmetic: each prompt as a chat, the user asking 'What is a<op>b?' (rendered by the "
        "model's chat template: for an instruction-tuned model); false: the bare 'a<op>b=' prompt",
    )
    terms: int = Field(
        1, ge=1, le=2,
        description="tool_arithmetic: 1 asks a<op>b; 2 asks a<op>b + c<op>d (the demonstration makes both calls in one "
        "turn, then adds)",
    )
    tool_format: str = Field(
        "tags", description="tool_arithmetic: how the system message and the demonstration write a call: tags "
        "(<calculator>EXPR</calculator>) or hermes (<tool_call>{json}</tool_call>; rollout.agent.tool_parser hermes)",
    )
    prompt_key: str = Field("question", min_length=1, description="the key / column holding the plain-text prompt")
    messages_key: str | None = Field(
        None, min_length=1, description="the key / column holding a chat [{role, content}, ...]; wins over prompt_key"
    )
    label_key: str = Field("answer", min_length=1, description="the key / column holding the label (string or integer)")
    id_key: str | None = Field(
        "id", min_length=1, description="the key / column holding a unique id; absent, null or unset: row-<index>"
    )
    metadata_keys: list[str] = Field(
        default_factory=list, description="keys / columns copied into the row's metadata (passed to reward functions)"
    )
    eval_path: str | None = Field(
        None, description="held-out rows for the eval (jsonl / parquet, same keys and reader as path); unset: no eval"
    )

    @field_validator("metadata_keys")
    @classmethod
    def _metadata_keys(cls, v: list[str]) -> list[str]:
        if any(not k for k in v):
            raise ValueError("keys must not be empty")
        if len(set(v)) != len(v):
            raise ValueError(f"keys must be unique, got {v}")
        return v

    @model_validator(mode="after")
    def _path(self) -> DataSpec:
        if self.kind != "reasoning_gym" and (self.dataset is not None or self.dataset_config):
            raise ValueError(f"dataset / dataset_config apply to kind reasoning_gym, not {self.kind!r} (remove them)")
        if self.kind == "reasoning_gym":
            if not self.dataset:
                raise ValueError("dataset (the reasoning-gym generator's name) is required when kind is 'reasoning_gym'")
            if self.path is not None or self.eval_path is not None:
                raise ValueError("path / eval_path are for jsonl / parquet; reasoning_gym generates its rows")
            return self
        if self.chat and self.kind != "arithmetic":
            raise ValueError(f"chat applies to kind arithmetic, not {self.kind!r} (remove it)")
        if self.kind != "tool_arithmetic" and (self.terms != 1 or self.tool_format != "tags"):
            raise ValueError(f"terms / tool_format apply to kind tool_arithmetic, not {self.kind!r} (remove them)")
        if self.tool_format not in ("tags", "hermes"):
            raise ValueError(f"tool_format must be tags or hermes, got {self.tool_format!r}")
        if self.terms == 2 and self.tool_format != "hermes":
            raise ValueError("terms 2 (two calls in one turn) needs tool_format hermes: a tags turn makes one call")
        if self.kind in ("arithmetic", "tool_arithmetic"):
            if self.min_operand > self.max_operand:
                raise ValueError(f"min_operand {self.min_operand} must be <= max_operand {self.max_operand}")
            if self.eval_path is not None:
                raise ValueError(f"eval_path is for jsonl / parquet; {self.kind} generates its rows")
            return self
        if not self.path:
            raise ValueError(f"path is required when kind is {self.kind!r}")
        suffixes = _DATA_SUFFIXES[self.kind]
        for name, value in (("path", self.path), ("eval_path", self.eval_path)):
            if value is not None and not value.lower().endswith(suffixes):
                raise ValueError(f"{name} {value!r} must end with {' or '.join(suffixes)} for kind {self.kind!r}")
        return self

    def eval_source(self) -> DataSpec | None:
        """The same mapping over ``eval_path`` (the held-out rows); None when there is none."""
        return self.model_copy(update={"path": self.eval_path}) if self.eval_path else None


__all__ = ["DataSpec"]
