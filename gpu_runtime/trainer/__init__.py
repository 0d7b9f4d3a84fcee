"""Trainer cell: the GRPO policy trainer, its process and its typed API."""

from gpu_runtime.trainer.api import TrainerHParams
from gpu_runtime.trainer.policy import PolicyTrainer

__all__ = ["PolicyTrainer", "TrainerHParams"]
