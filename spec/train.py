"""The ``train`` and ``sft`` sections of the run config: the RL update's knobs and the
supervised warm-up's, each declared once with its default and validation, and
``HParamUpdate``, the mid-run change of ``train`` (``set_hparams``). Torch-free."""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, create_model, field_validator, model_validator
from pydantic.fields import FieldInfo

from spec.strict import Strict


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
    def _combinations(self) -> TrainSpec:
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


# ``train`` knobs only the RL loss reads: in mode sft each must keep its default
RL_ONLY_TRAIN_FIELDS = ("estimator", "clip_eps", "clip_eps_high", "dual_clip_c", "kl_coef", "kl_estimator",
                        "kl_in_reward", "entropy_coef", "tis_cap", "scale_adv_by_std", *PPO_ONLY_TRAIN_FIELDS)


def mode_conflicts(mode: str, train: TrainSpec) -> list[str]:
    """The ``train`` fields set away from their default that ``mode`` does not use."""
    if mode != "sft":
        return []
    default = TrainSpec()
    return [f for f in RL_ONLY_TRAIN_FIELDS if getattr(train, f) != getattr(default, f)]

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
    fields: dict[str, Any] = {}
    for name, f in model.model_fields.items():
        assert f.annotation is not None  # a pydantic model's field always has one
        fields[name] = (f.annotation | None, FieldInfo.merge_field_infos(f, default=None))
    return fields


# the ``train`` fields whose value may be null (off / unset), which ``set_hparams`` can set back to null
NULLABLE_TRAIN_FIELDS = tuple(n for n, f in TrainSpec.model_fields.items() if type(None) in typing.get_args(f.annotation))

# ``set_hparams``: any ``train`` field, changed between steps. Derived from TrainSpec
# so a knob is declared once; ``apply`` re-validates the merged section.
if TYPE_CHECKING:  # the fields are TrainSpec's, made at import: a type checker reads each as Any
    class HParamUpdate(_TrainUpdate):
        def __getattr__(self, name: str) -> Any: ...
else:
    HParamUpdate = create_model(
        "HParamUpdate", __base__=_TrainUpdate, __module__=__name__, **_all_optional(TrainSpec)
    )

