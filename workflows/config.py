"""The run configuration: one validated pydantic model, torch-free.

Unknown keys are errors (``extra="forbid"``) so a typo never silently falls
back to a default. ``load_run_config`` reports the YAML key path of a bad field.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from workflows.agent_config import AgentSpec
from workflows.data_config import DataSpec  # noqa: F401  (a section of RunConfig; re-exported)
from workflows.engine_config import EngineSpec  # noqa: F401  (a section of RunConfig; re-exported)
from workflows.model_config import DistillSpec, LoraSpec, ModelInitSpec, ModelSpec  # noqa: F401  (sections; re-exported)
from workflows.reward_config import RewardSpec, RewardTerm  # noqa: F401  (a section of RunConfig; re-exported)
from workflows.strict import Strict
from workflows.trainer_config import RunAsks, TrainerSpec, layout_conflicts


def adam_betas(v: tuple[float, float]) -> tuple[float, float]:
    """AdamW betas: each in [0, 1)."""
    for i, b in enumerate(v):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
    return v


class SFTSpec(Strict):
    """Supervised warm-up before RL (version 0 of the policy)."""

    steps: int = Field(300, ge=0)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-4, gt=0)
    grad_clip: float | None = Field(None, gt=0, description="max grad norm during SFT (unset: no clipping)")
    betas: tuple[float, float] = Field(
        (0.9, 0.95), description="AdamW betas of the warm-up, each in [0, 1). beta2 0.95, not 0.999: see docs/config.md"
    )

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        return adam_betas(v)


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
    def _dynamic(self) -> "RolloutSpec":
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


# ``train`` knobs only estimator ppo reads (its critic and GAE)
PPO_ONLY_TRAIN_FIELDS = ("gamma", "lam", "vf_coef", "value_clip", "critic_lr", "critic_warmup_steps")


class TrainSpec(Strict):
    """The RL update (an advantage estimator, a clipped policy loss, AdamW): the one place
    each trainer knob is declared, with its default. Every field can change between steps
    with ``milestone set`` (each step's values are stored with it, so replay reuses them).
    ``docs/algorithms.md`` gives each knob's formula."""

    lr: float = Field(3e-5, gt=0, description="AdamW learning rate (after warm-up)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1)")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0, description="linear lr warm-up over this many optimizer steps, then constant")
    grad_clip: float = Field(1.0, gt=0, description="max global grad norm")
    estimator: Literal["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "cispo", "ppo"] = Field(
        "grpo",
        description="grpo: group-normalised advantages, PPO-clip loss; rloo: leave-one-out baseline; "
        "reinforce_pp(_baseline): token returns (minus the group mean) whitened over the batch; "
        "gspo: GRPO advantages, sequence-ratio clip; cispo: GRPO advantages, clipped stop-gradient IS weight; "
        "ppo: a critic (value model) and GAE advantages, PPO-clip loss",
    )
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip (low side; also the high side unless clip_eps_high)")
    # no upper bound: CISPO's truncation 1 + clip_eps_high is typically well above 2
    clip_eps_high: float | None = Field(
        None, gt=0, description="the ratio's upper clip 1 + clip_eps_high (DAPO clip-higher; cispo's IS weight cap)"
    )
    dual_clip_c: float | None = Field(
        None, gt=1, description="dual-clip PPO: for A < 0 the per-token loss is capped at -A * c (unset: off)"
    )
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = Field(
        "token_mean", description="how per-token losses become the batch loss (the last divides by loss_agg_norm_len)"
    )
    loss_agg_norm_len: int | None = Field(
        None, ge=1, description="the constant seq_mean_token_sum_norm divides by (Dr.GRPO; e.g. rollout.max_new_tokens)"
    )
    kl_coef: float = Field(0.0, ge=0, description="KL to the post-SFT reference; > 0 keeps a reference model")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="the per-token KL estimator (Schulman)")
    kl_in_reward: bool = Field(
        False, description="KL as a reward penalty (kl_coef * KL per token) instead of a loss term"
    )
    entropy_coef: float = Field(
        0.0, ge=0, description="entropy bonus: entropy_coef * entropy is subtracted from the loss"
    )
    tis_cap: float | None = Field(
        None, ge=1,
        description="truncated IS against the engine's logprobs: weight min(exp(trainer - engine), cap) (unset: off)",
    )
    scale_adv_by_std: bool = Field(
        True, description="grpo/gspo/cispo: divide group advantages by the group std (false: Dr.GRPO)"
    )
    ppo_epochs: int = Field(1, ge=1, description="optimizer steps per rollout batch")
    micro_batch_size: int = Field(128, ge=1, description="sequences per forward/backward (gradients accumulate)")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="fp32: everything float32; bf16: the policy's forward/backward under bf16 autocast "
        "(weights, grads, AdamW states and the loss math stay float32; docs/trainer-backends.md)",
    )
    # estimator ppo only (the critic and GAE)
    gamma: float = Field(1.0, ge=0, le=1, description="ppo: GAE discount per response token")
    lam: float = Field(0.95, ge=0, le=1, description="ppo: GAE lambda (1: Monte-Carlo returns, 0: one-step TD)")
    vf_coef: float = Field(1.0, gt=0, description="ppo: weight of the value loss (scales the critic's gradient)")
    value_clip: float | None = Field(
        0.5, gt=0, description="ppo: clip the new values to old +- value_clip in the value loss (unset: unclipped)"
    )
    critic_lr: float | None = Field(None, gt=0, description="ppo: the critic's AdamW learning rate (unset: lr)")
    critic_warmup_steps: int = Field(
        0, ge=0, description="ppo: the critic's first k steps train the critic only (the policy is not updated)"
    )

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        return adam_betas(v)

    @model_validator(mode="after")
    def _combinations(self) -> "TrainSpec":
        est = self.estimator
        if self.dual_clip_c is not None and est in ("gspo", "cispo"):
            raise ValueError(
                f"dual_clip_c applies to the PPO-clip loss; estimator {est} has its own (leave dual_clip_c unset)"
            )
        if est == "gspo" and self.loss_agg != "seq_mean_token_mean":
            raise ValueError(
                "estimator gspo needs loss_agg seq_mean_token_mean (its objective is a mean over sequences), "
                f"got {self.loss_agg}"
            )
        if self.loss_agg == "seq_mean_token_sum_norm" and self.loss_agg_norm_len is None:
            raise ValueError(
                "loss_agg seq_mean_token_sum_norm needs loss_agg_norm_len (the constant length, e.g. rollout.max_new_tokens)"
            )
        if self.kl_in_reward and self.kl_coef == 0:
            raise ValueError("kl_in_reward needs kl_coef > 0 (the penalty's weight)")
        if est != "ppo":
            moved = [f for f in PPO_ONLY_TRAIN_FIELDS if getattr(self, f) != type(self).model_fields[f].default]
            if moved:
                raise ValueError(f"{', '.join(moved)}: critic / GAE knobs of estimator ppo, unused by {est} "
                                 "(leave them at their defaults)")
        if not self.scale_adv_by_std and est not in ("grpo", "gspo", "cispo"):
            raise ValueError(
                f"scale_adv_by_std false applies to grpo, gspo and cispo; estimator {est} never divides by the group std "
                "(set scale_adv_by_std true)"
            )
        return self


class CheckpointSpec(Strict):
    every: int = Field(5, ge=1, description="checkpoint every k steps")
    keep_last: int = Field(3, ge=1)


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


# the truncated-IS cap a one_step_off or fully_async run gets when its config does not set train.tis_cap
ONE_STEP_OFF_TIS_CAP = 2.0
OFF_POLICY_MODES = ("one_step_off", "fully_async")  # rollout.mode values that train on older weights' samples

# ``train`` knobs only the RL loss reads: in mode sft each must keep its default
RL_ONLY_TRAIN_FIELDS = ("estimator", "clip_eps", "clip_eps_high", "dual_clip_c", "kl_coef", "kl_estimator",
                        "kl_in_reward", "entropy_coef", "tis_cap", "scale_adv_by_std", *PPO_ONLY_TRAIN_FIELDS)


def mode_conflicts(mode: str, train: TrainSpec) -> list[str]:
    """The ``train`` fields set away from their default that ``mode`` does not use."""
    if mode != "sft":
        return []
    default = TrainSpec()
    return [f for f in RL_ONLY_TRAIN_FIELDS if getattr(train, f) != getattr(default, f)]


class NodeSpec(Strict):
    """How fast a lost node agent is noticed. During each step the node runs a
    ``node_liveness`` activity that heartbeats every ``liveness_interval_s``; when no
    heartbeat arrives for ``liveness_timeout_s`` the step fails as ``NodeLost`` and the
    run moves to another node. 0 turns the watch off (the activities' own 15 s heartbeat
    and schedule-to-start timeouts still apply, about 30 s)."""

    liveness_timeout_s: float = Field(3.0, ge=0, description="no node heartbeat for this long: the node is lost (0: off)")
    liveness_interval_s: float = Field(0.5, gt=0, description="seconds between the node's liveness heartbeats")

    @model_validator(mode="after")
    def _margin(self) -> "NodeSpec":
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


class _TrainUpdate(Strict):
    # optional knobs to set back to null (``milestone set tis_cap=null``): a field's None means "not given"
    unset: list[str] = Field(default_factory=list)

    @field_validator("unset")
    @classmethod
    def _unset(cls, v: list[str]) -> list[str]:
        bad = [k for k in v if k not in NULLABLE_TRAIN_FIELDS]
        if bad:
            raise ValueError(f"{', '.join(bad)}: only these train fields can be null: {', '.join(NULLABLE_TRAIN_FIELDS)}")
        return v

    def _changes(self) -> dict[str, object]:
        fields = self.model_dump(mode="json", exclude={"unset"})
        return {**{k: v for k, v in fields.items() if v is not None}, **{k: None for k in self.unset}}

    def apply(self, train: TrainSpec) -> TrainSpec:
        return TrainSpec.model_validate({**train.model_dump(), **self._changes()})

    def given(self) -> dict[str, object]:
        return self._changes()


def _all_optional(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s fields, each optional with default None and its own constraints."""
    return {
        name: (f.annotation | None, FieldInfo.merge_field_infos(f, default=None))
        for name, f in model.model_fields.items()
    }


# the ``train`` fields whose value may be null (off / unset), which ``set_hparams`` can set back to null
NULLABLE_TRAIN_FIELDS = tuple(n for n, f in TrainSpec.model_fields.items() if type(None) in typing.get_args(f.annotation))

# ``set_hparams``: any ``train`` field, changed between steps. Derived from TrainSpec
# so a knob is declared once; ``apply`` re-validates the merged section.
HParamUpdate = create_model(
    "HParamUpdate", __base__=_TrainUpdate, __module__=__name__, **_all_optional(TrainSpec)
)


def format_validation_error(err: ValidationError, where: Callable[[tuple], str | None] | None = None) -> str:
    """One ``key.path: message`` line per error of a pydantic ``ValidationError``.

    ``where(loc)`` may prefix a line with the error's origin (the CLI passes one
    that returns ``file:line``); the workflow names only the key path.
    """
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = ".".join(str(p) for p in loc) or "<root>"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        origin = where(loc) if where is not None else None
        lines.append(f"{origin}: {key}: {msg}" if origin else f"{key}: {msg}")
    return "\n".join(lines)
