"""The run configuration: ``RunConfig``, one validated pydantic model of every section
(each section in its own module of ``spec``), and the small sections that only the
run reads (``checkpoint``, ``eval``, ``node``). Torch-free.

Unknown keys are errors (``extra="forbid"``) so a typo never silently falls
back to a default. ``load_run_config`` reports the YAML key path of a bad field.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from spec.data import DataSpec
from spec.engine import EngineSpec
from spec.model import DistillSpec, ModelSpec
from spec.reward import RewardSpec
from spec.rollout import OFF_POLICY_MODES, ONE_STEP_OFF_TIS_CAP, RolloutSpec
from spec.strict import Strict
from spec.train import SFTSpec, TrainSpec, mode_conflicts
from spec.trainer import RunAsks, TrainerSpec, layout_conflicts


class CheckpointSpec(Strict):
    every: int = Field(5, ge=1, description="checkpoint every k steps")
    keep_last: int = Field(3, ge=1)
    keep_versions: list[int] = Field(
        default_factory=list,
        description="policy versions whose model folder the store keeps for the rest of the run, beside v0, the "
        "kept checkpoints' and the last step's: version N is checkpointed after step N (docs/cost-per-step.md)",
    )

    @field_validator("keep_versions")
    @classmethod
    def _versions(cls, v: list[int]) -> list[int]:
        if bad := [n for n in v if n < 1]:
            raise ValueError(f"keep_versions {bad}: versions are steps, 1 or more (v0 is always kept)")
        return sorted(set(v))


class EvalSpec(Strict):
    """Held-out evaluation after a step: greedy pass@1 and sampled pass@k on the run's
    eval split (``prepare_data`` writes it: generated for ``arithmetic``, read from
    ``data.eval_path`` for jsonl / parquet). Scored with the math answer rule."""

    enabled: bool = Field(True, description="false: never evaluate (no eval split is written)")
    every: int = Field(
        0, ge=0, description="evaluate after every k-th step, and always after the last step (0: only after the last)"
    )
    n: int = Field(100, ge=1, description="held-out prompts (fixed when the data is prepared)")
    k: int = Field(4, ge=1, description="samples per prompt for pass@k")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of the pass@k samples (greedy is separate)")
    max_new_tokens: int | None = Field(None, ge=1, description="response length cap (unset: rollout.max_new_tokens)")

    def due(self, step: int, last_step: int) -> bool:
        """Whether the eval runs after ``step`` of a run of ``last_step`` steps."""
        return self.enabled and (step == last_step or (self.every > 0 and step % self.every == 0))


class NodeSpec(Strict):
    """How fast a lost node agent is noticed. During each step the node runs a
    ``node_liveness`` activity that heartbeats every ``liveness_interval_s``; when no
    heartbeat arrives for ``liveness_timeout_s`` the step fails as ``NodeLost`` and the
    run moves to another node. 0 turns the watch off (the activities' own 15 s heartbeat
    and schedule-to-start timeouts still apply, about 30 s)."""

    liveness_timeout_s: float = Field(3.0, ge=0, description="no node heartbeat for this long: the node is lost (0: off)")
    liveness_interval_s: float = Field(0.5, gt=0, description="seconds between the node's liveness heartbeats")

    @model_validator(mode="after")
    def _margin(self) -> NodeSpec:
        if self.liveness_timeout_s and self.liveness_interval_s * 3 > self.liveness_timeout_s:
            raise ValueError("liveness_interval_s must be at most a third of liveness_timeout_s")
        return self


class RunConfig(Strict):
    name: str = "milestone-run"
    seed: int = 1
    steps: int = Field(30, ge=1, description="steps to run in total (RL steps; SFT steps in mode sft)")
    store: str = Field("file://.milestone/store", description="file:// or s3:// root for artifacts and checkpoints")
    # before the sections it constrains (their validators read it)
    mode: Literal["rl", "sft"] = Field(
        "rl",
        description="rl: each step samples, scores and takes an RL update; sft: each step trains on sft.batch_size "
        "dataset rows (prompt -> label, loss on the label tokens), no rollout or reward",
    )
    distill: DistillSpec | None = Field(
        None, description="on-policy distillation: a per-token reverse-KL advantage against a teacher folder"
    )
    model: ModelSpec = ModelSpec()
    data: DataSpec = DataSpec()
    sft: SFTSpec = Field(SFTSpec(), validate_default=True)  # checked against mode also when omitted
    rollout: RolloutSpec = Field(RolloutSpec(), validate_default=True)  # checked against mode also when omitted
    reward: RewardSpec = Field(RewardSpec(), validate_default=True)  # checked against mode also when omitted
    train: TrainSpec = Field(TrainSpec(), validate_default=True)  # checked against mode also when omitted
    checkpoint: CheckpointSpec = CheckpointSpec()
    eval: EvalSpec = Field(EvalSpec(), validate_default=True)  # checked against rollout.agent also when omitted
    engines: EngineSpec = Field(EngineSpec(), validate_default=True)  # release_memory is checked against rollout.mode
    node: NodeSpec = NodeSpec()
    # after the sections it constrains (its validator reads them)
    trainer: TrainerSpec = Field(TrainerSpec(), validate_default=True)
    steps_per_workflow_run: int = Field(
        50, ge=1, description="continue-as-new after this many steps (keeps history small)"
    )

    @field_validator("checkpoint")
    @classmethod
    def _kept_versions(cls, v: CheckpointSpec, info: ValidationInfo) -> CheckpointSpec:
        steps = info.data.get("steps")
        if steps is not None and (bad := [n for n in v.keep_versions if n > steps]):
            raise ValueError(f"keep_versions {bad}: the run has {steps} steps, so its last version is v{steps}")
        return v

    @field_validator("engines")
    @classmethod
    def _release_memory(cls, v: EngineSpec, info: ValidationInfo) -> EngineSpec:
        """Phases that overlap cannot take turns on the GPU: ``on`` is refused and ``auto``
        becomes ``off`` when the rollout of a later step runs during ``train_step``."""
        rollout = info.data.get("rollout")
        mode = rollout.mode if rollout is not None else "sync"
        if mode == "sync" or v.release_memory == "off":
            return v
        if v.release_memory == "on":
            raise ValueError(
                f"engines.release_memory on needs rollout.mode sync: in {mode} the engines generate the next batch while "
                "the trainer trains, so neither can give its memory to the other (set engines.release_memory: off "
                "or auto, or rollout.mode: sync)"
            )
        return v.model_copy(update={"release_memory": "off"})

    @field_validator("store")
    @classmethod
    def _store(cls, v: str) -> str:
        if not (v.startswith("file://") or v.startswith("s3://")):
            raise ValueError("store must start with file:// or s3://")
        if v.startswith("s3://") and "@" in v.removeprefix("s3://").split("/", 1)[0]:
            # the config is a workflow input, kept in history forever: never echo the value
            raise ValueError(
                "an s3:// store URI holds no credentials (s3://bucket/prefix); the workers read "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY from their environment"
            )
        return v

    @field_validator("distill")
    @classmethod
    def _distill_mode(cls, v: DistillSpec | None, info: ValidationInfo) -> DistillSpec | None:
        if v is not None and info.data.get("mode") == "sft":
            raise ValueError("on-policy distillation needs the student's samples: it applies to mode rl")
        return v

    @field_validator("sft")
    @classmethod
    def _sft_mode(cls, v: SFTSpec, info: ValidationInfo) -> SFTSpec:
        if info.data.get("mode") == "sft" and v.steps:
            raise ValueError(
                "steps is the warm-up before RL: set it to 0 in mode sft, where the run's own steps train on the labels"
            )
        return v

    @field_validator("rollout")
    @classmethod
    def _rollout_mode(cls, v: RolloutSpec, info: ValidationInfo) -> RolloutSpec:
        if info.data.get("mode") == "sft" and v.dynamic_filter.enabled:
            raise ValueError("dynamic_filter applies to mode rl (mode sft samples nothing)")
        if info.data.get("mode") == "sft" and v.mode != "sync":
            raise ValueError(f"mode {v.mode} overlaps rollout with training: mode sft has no rollout (use sync)")
        if info.data.get("mode") == "sft" and v.agent is not None:
            raise ValueError("agent applies to mode rl (mode sft samples nothing)")
        data = info.data.get("data")
        if data is not None and data.kind == "tool_arithmetic" and v.agent is None:
            raise ValueError("data.kind tool_arithmetic is a calculator task: set rollout.agent (e.g. {tools: [calculator]})")
        return v

    @field_validator("reward")
    @classmethod
    def _reward_mode(cls, v: RewardSpec, info: ValidationInfo) -> RewardSpec:
        if info.data.get("mode") == "sft" and v != RewardSpec():
            raise ValueError("the reward applies to mode rl (mode sft scores nothing): remove the section")
        data = info.data.get("data")
        if "reasoning_gym" in v.kinds() and data is not None and data.kind != "reasoning_gym":
            raise ValueError(f"kind reasoning_gym scores rows of data.kind reasoning_gym, not {data.kind!r}")
        return v

    @field_validator("eval")
    @classmethod
    def _eval_agent(cls, v: EvalSpec, info: ValidationInfo) -> EvalSpec:
        rollout = info.data.get("rollout")
        if rollout is not None and rollout.agent is not None and v.enabled:
            raise ValueError(
                "enabled: the held-out eval samples one response per prompt, not episodes; with rollout.agent "
                "set eval.enabled false (the rollout metrics report episode outcomes and rewards)"
            )
        return v

    @field_validator("train")
    @classmethod
    def _train_mode(cls, v: TrainSpec, info: ValidationInfo) -> TrainSpec:
        bad = mode_conflicts(str(info.data.get("mode")), v)
        if bad:
            raise ValueError(
                f"{', '.join(bad)}: RL loss knobs, unused in mode sft (which minimises the labels' negative "
                "log-likelihood): leave them at their defaults"
            )
        rollout = info.data.get("rollout")
        if rollout is not None and rollout.mode in OFF_POLICY_MODES and "tis_cap" not in v.model_fields_set:
            # off-policy samples get truncated IS unless the config says otherwise (tis_cap: null turns it off)
            v = v.model_copy(update={"tis_cap": ONE_STEP_OFF_TIS_CAP})  # counts as set: a re-validation keeps it
        return v

    @field_validator("trainer")
    @classmethod
    def _trainer_backend(cls, v: TrainerSpec, info: ValidationInfo) -> TrainerSpec:
        model, train, rollout = info.data.get("model"), info.data.get("train"), info.data.get("rollout")
        asks = RunAsks(mode=str(info.data.get("mode")), lora=model is not None and model.lora is not None,
                       distill=info.data.get("distill") is not None,
                       agent=rollout is not None and rollout.agent is not None, train=train)
        if v.cells > 1 and (bad := layout_conflicts("cells", asks)):
            raise ValueError(f"cells {v.cells} does not support {'; '.join(bad)}")
        if v.backend == "single":
            return v
        if bad := layout_conflicts(v.backend, asks):
            docs = " (docs/trainer-backends.md)" if v.backend == "megatron" else ""
            raise ValueError(f"backend {v.backend} does not support {'; '.join(bad)}{docs}")
        if v.backend == "megatron":
            return v
        if train is not None and rollout is not None:
            n = math.ceil(rollout.prompts_per_step * rollout.group_size / train.micro_batch_size)
            if n % v.ranks_per_cell:
                raise ValueError(
                    f"ranks_per_cell {v.ranks_per_cell} must divide the step's {n} micro-batches "
                    f"(rollout.prompts_per_step x group_size / train.micro_batch_size, rounded up): "
                    "every rank trains the same number"
                )
        return v

    @property
    def samples_per_step(self) -> int:
        return self.rollout.prompts_per_step * self.rollout.group_size

