"""The RL optimizer of a trainer holding a ``model``: AdamW over its trainable parameters,
the LR schedule's position ``opt_steps``, and one clipped step. Shared by the HF
``PolicyTrainer`` (and its fsdp2 rank subclass; a DP cell overrides the step) and the
``MegatronTrainer``, so both backends step the same way from the same ``train`` knobs.
The optimizer saves and loads itself (``optimizer_state`` / ``load_optimizer_state``); the
schedule's position is part of the trainer's progress (``state_io.restore_progress``)."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from gpu_runtime.trainer.common import lora as lora_lib
from gpu_runtime.trainer.common.batches import lr_at
from gpu_runtime.trainer.common.state_io import load_optimizer_tensors, optimizer_tensors
from spec.train import TrainSpec


class AdamWSteps:
    model: torch.nn.Module
    optimizer: torch.optim.AdamW
    opt_steps: int  # LR-schedule position (optimizer steps taken in RL)

    def new_optimizer(self, hp: TrainSpec, lr: float | None = None) -> torch.optim.AdamW:
        """A fresh AdamW over the model's trainable parameters (``lr``: other than ``hp.lr``)."""
        return torch.optim.AdamW(
            lora_lib.trainable_parameters(self.model), lr=hp.lr if lr is None else lr, betas=hp.betas, eps=hp.eps,
            weight_decay=hp.weight_decay, foreach=False,
        )

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], list[dict]]:
        """AdamW's state as flat tensors and its param groups (``state_io.optimizer_tensors``)."""
        return optimizer_tensors(self.optimizer)

    def load_optimizer_state(self, hp: TrainSpec, flat: dict[str, torch.Tensor], groups: list[dict]) -> None:
        """A fresh AdamW for ``hp`` holding the state ``optimizer_state`` returned."""
        self.optimizer = self.new_optimizer(hp)
        load_optimizer_tensors(self.optimizer, flat, groups)

    def lr_at(self, step: int, hp: TrainSpec) -> float:
        return lr_at(step, hp)

    def start_optimizer_step(self, hp: TrainSpec) -> float:
        """Set the step's LR (schedule position ``opt_steps``) and AdamW knobs, clear the grads."""
        lr = self.lr_at(self.opt_steps, hp)
        for group in self.optimizer.param_groups:
            group.update(lr=lr, betas=hp.betas, eps=hp.eps, weight_decay=hp.weight_decay)
        self.optimizer.zero_grad(set_to_none=True)
        return lr

    def take_optimizer_step(self, hp: TrainSpec, what: str) -> float:
        """Clip the accumulated grads to ``hp.grad_clip`` and step; the grad norm before clipping.
        A non-finite norm is a FloatingPointError and the weights stay the last good ones."""
        total = torch.nn.utils.clip_grad_norm_(lora_lib.trainable_parameters(self.model), hp.grad_clip)
        grad_norm = float(total.full_tensor() if isinstance(total, DTensor) else total)  # a fsdp2 rank's is sharded
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"{what}: grad norm is not finite ({grad_norm})")
        self.optimizer.step()
        self.opt_steps += 1
        return grad_norm
