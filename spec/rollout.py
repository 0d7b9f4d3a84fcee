"""The ``rollout`` section of the run config: how a step samples (torch-free)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from spec.agent import AgentSpec
from spec.strict import Strict


class DynamicFilterSpec(Strict):
    """DAPO dynamic sampling: drop groups whose rewards are all equal (no learning signal)
    and draw more prompts, round by round, until ``prompts_per_step`` groups are kept."""

    enabled: bool = Field(False, description="filter zero-variance groups and sample more rounds")
    max_rounds: int = Field(4, ge=1, description="sampling rounds per step at most (each draws new prompts)")
    on_shortfall: Literal["train", "fail"] = Field(
        "train",
        description="fewer groups kept than prompts_per_step after max_rounds: train on the kept ones "
        "(none kept: on the first round's first prompts_per_step groups), or fail the step",
    )


DEFAULT_MAX_STALENESS = 2  # rollout.max_staleness (fully_async): batches sampled ahead


class RolloutSpec(Strict):
    prompts_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1, description="samples per prompt (GRPO group)")
    chunk_size: int = Field(32, ge=1, description="samples per chunk: the unit of generation, storage and retry")
    max_new_tokens: int = Field(8, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    stop: list[str] = Field(
        default_factory=list,
        description="stop strings (SGLang's stop): a sample ends once its text contains one; the string is kept",
    )
    stop_token_ids: list[int] = Field(
        default_factory=list, description="token ids that end a sample besides EOS (SGLang's stop_token_ids); kept"
    )
    oversample: float = Field(
        1.0, ge=1.0, description="with dynamic_filter: each round draws ceil(prompts_per_step * oversample) prompts"
    )
    dynamic_filter: DynamicFilterSpec = DynamicFilterSpec()
    mode: Literal["sync", "one_step_off", "fully_async"] = Field(
        "sync",
        description="sync: step n samples on the policy step n-1 produced; one_step_off: step n+1's rollout runs on "
        "the same weights as step n's, during step n's train_step (samples one version old, corrected by TIS); "
        "fully_async: a buffer of up to max_staleness batches sampled ahead, each step trains the oldest "
        "(docs/rollout-modes.md)",
    )
    max_staleness: int = Field(
        DEFAULT_MAX_STALENESS, ge=1,
        description="fully_async: batches sampled ahead (the buffer's depth), so a trained batch is at most this "
        "many policy versions older than the weights it trains",
    )
    agent: AgentSpec | None = Field(
        None, description="multi-turn tool-calling episodes (docs/agents.md); unset: one response per prompt"
    )

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError(f"token ids must be >= 0, got {v}")
        return v

    @model_validator(mode="after")
    def _dynamic(self) -> RolloutSpec:
        if self.dynamic_filter.enabled and self.group_size < 2:
            raise ValueError("dynamic_filter.enabled needs group_size >= 2 (a group of one never varies)")
        if self.oversample != 1.0 and not self.dynamic_filter.enabled:
            raise ValueError("oversample applies with dynamic_filter.enabled only (set it, or leave oversample at 1)")
        return self

    @field_validator("max_staleness")
    @classmethod
    def _staleness_needs_fully_async(cls, v: int, info: ValidationInfo) -> int:
        """A field validator (``mode`` is declared before it), so the error names
        ``rollout.max_staleness``; a default is not validated, so only a set value is checked."""
        mode = info.data.get("mode")  # absent: mode itself was invalid, and that is the error
        if mode is not None and mode != "fully_async" and v != DEFAULT_MAX_STALENESS:
            raise ValueError(
                f"max_staleness applies to mode fully_async (mode {mode} has staleness "
                f"{1 if mode == 'one_step_off' else 0}): set mode: fully_async, or remove max_staleness"
            )
        return v

    @property
    def prompts_per_round(self) -> int:
        """Prompts drawn by each dynamic-sampling round (``prompts_per_step`` without the filter)."""
        return math.ceil(self.prompts_per_step * self.oversample - 1e-9)


# the truncated-IS cap a one_step_off or fully_async run gets when its config does not set train.tis_cap
ONE_STEP_OFF_TIS_CAP = 2.0
OFF_POLICY_MODES = ("one_step_off", "fully_async")  # rollout.mode values that train on older weights' samples


def rl_sampling_conflicts(rollout: RolloutSpec) -> list[tuple[str, str]]:
    """(field, why) for each sampling setting an RL run cannot train: the trainer trains the
    policy that sampled, ``log_softmax(logits / temperature)`` over the whole vocabulary, and
    the engines report that same distribution's logprobs (docs/algorithms.md, "Temperature").
    Greedy sampling has no such distribution; top-p / top-k sample a truncated one the trainer
    does not compute. Checked when a run starts (``milestone start`` / ``fork``, and a new
    ``TrainingRun``), not by ``RolloutSpec`` itself: a recorded history must always decode."""
    bad = []
    if rollout.temperature <= 0:
        bad.append(("rollout.temperature", "0 samples greedily: every sample of a group is the same and there is no "
                    "sampling distribution to train (set it > 0; the held-out eval measures greedy accuracy)"))
    if rollout.top_p < 1:
        bad.append(("rollout.top_p", f"{rollout.top_p} is not supported in mode rl: the trainer's logprobs, ratio and "
                    "KL are of the full distribution at rollout.temperature, not a top-p truncated one (set 1.0)"))
    if rollout.top_k > 0:
        bad.append(("rollout.top_k", f"{rollout.top_k} is not supported in mode rl: the trainer's logprobs, ratio and "
                    "KL are of the full distribution at rollout.temperature, not a top-k truncated one (set -1)"))
    return bad
