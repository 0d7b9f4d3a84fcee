"""Trainer cell: the GRPO policy trainer and its hyperparameters."""

from gpu_runtime.trainer.hparams import TrainerHParams
from gpu_runtime.trainer.policy import PolicyTrainer, greedy_generate

__all__ = ["PolicyTrainer", "TrainerHParams", "greedy_generate"]
