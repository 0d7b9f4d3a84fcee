"""Trainer hyperparameters (validated; ``set_hparams`` updates go through this model)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TrainerHParams(BaseModel):
    """Defaults are the CPU demo's tuned values (2-digit addition, hidden 256 / 4 layers,
    16 prompts x 8 samples): SFT 300 x 64 at 1e-3 (~63 % greedy), then GRPO at 1e-4
    with 2 optimizer steps per rollout. 3e-4 (1 step per rollout) lowered accuracy."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(default=1e-4, gt=0, description="RL learning rate (AdamW)")
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(default=0.0, ge=0)
    eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon")
    warmup_steps: int = Field(default=0, ge=0, description="linear LR warm-up in optimizer steps, then constant")
    grad_clip: float = Field(default=1.0, gt=0, description="max global grad norm")
    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    clip_eps_high: float | None = Field(default=None, gt=0, description="DAPO clip-higher; None = clip_eps")
    kl_coef: float = Field(default=0.0, ge=0, description="k3 KL to the frozen post-SFT reference")
    scale_adv_by_std: bool = True
    ppo_epochs: int = Field(default=2, ge=1, description="optimizer steps per rollout")
    micro_batch_size: int = Field(default=128, ge=1, description="sequences per forward/backward")
    sft_steps: int = Field(default=300, ge=0)
    sft_batch_size: int = Field(default=64, ge=1)
    sft_lr: float = Field(default=1e-3, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "TrainerHParams":
        for i, b in enumerate(self.betas):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"trainer.betas[{i}] must be in [0, 1), got {b}")
        return self
