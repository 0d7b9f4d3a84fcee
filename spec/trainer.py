"""The ``trainer`` section: how the policy is trained across processes (torch-free).

``single`` is one trainer process holding the whole model. ``fsdp2`` is a cell of
``ranks_per_cell`` ranks (Ray actors in one placement group, driven by the node's trainer
process), the policy sharded with FSDP2 per decoder layer. ``megatron`` is one trainer
process holding a megatron-core GPTModel (converted from the HF folder, converted back
for every published version); it needs a ``--device cuda`` node and megatron-core (the
``[gpu]`` extra). See docs/trainer-backends.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from spec.strict import Strict
from spec.train import TrainSpec


class TrainerSpec(Strict):
    """Fixed for a run (unlike ``train``, which can change between steps): the placement
    of the trainer's ranks."""

    backend: Literal["single", "fsdp2", "megatron"] = Field(
        "single", description="single: one trainer process; fsdp2: a cell of ranks_per_cell FSDP2 ranks placed by "
        "Ray; megatron: one process training a megatron-core GPTModel (needs --device cuda and the [gpu] extra)"
    )
    ranks_per_cell: int = Field(1, ge=1, description="ranks of the fsdp2 cell (one torch.distributed group)")
    placement: Literal["strict_pack", "spread"] = Field(
        "strict_pack", description="the cell's Ray placement group: strict_pack (all ranks on one node) or spread "
        "(ranks on different nodes where the cluster has them)"
    )
    ray_address: str | None = Field(
        None, description="an existing Ray cluster to place the cell on (e.g. 127.0.0.1:6379); unset: "
        "$MILESTONE_RAY_ADDRESS on the node, else a Ray instance the trainer process starts and stops itself"
    )
    collective_timeout_s: float = Field(
        120.0, gt=0, description="a collective (gloo/NCCL) waiting longer fails the step retryably: a hung or "
        "stopped rank costs this, not gloo's 30-minute default; with cells > 1 also what a hung cell costs its peers"
    )
    cells: int = Field(
        1, ge=1, le=64, description="independent data-parallel cells joined by torchft: a lost cell never stops "
        "the step (its peers commit it), and the run restarts it, healed from a peer (docs/dp-cells.md)"
    )
    cell_restart_backoff_s: float = Field(
        5.0, gt=0, description="a lost DP cell is restarted this long after its loss, then after 2x, 4x, ... "
        "as restarts fail (5 s * 2^k, like Miles' FT controller)"
    )
    cell_restart_backoff_max_s: float = Field(300.0, gt=0, description="the cap of that backoff")

    @model_validator(mode="after")
    def _ranks(self) -> TrainerSpec:
        if self.backend == "megatron":
            if self.ranks_per_cell != 1:
                raise ValueError(f"ranks_per_cell {self.ranks_per_cell}: backend megatron runs one process "
                                 "(tensor/pipeline parallel ranks are not built yet)")
            if self.cells != 1:
                raise ValueError(f"cells {self.cells}: backend megatron runs one cell (megatron cells joined by "
                                 "torchft are not built yet)")
            if self.placement != "strict_pack" or self.ray_address is not None:
                raise ValueError("placement and ray_address need backend fsdp2 (backend megatron uses no Ray)")
            return self
        if self.backend == "single" and self.ranks_per_cell != 1:
            raise ValueError(
                f"ranks_per_cell {self.ranks_per_cell} needs backend fsdp2 (backend single is one process)"
            )
        if self.backend == "single" and (self.placement != "strict_pack" or self.ray_address is not None):
            raise ValueError("placement and ray_address need backend fsdp2 (backend single uses no Ray)")
        if self.cells > 1 and self.backend != "single":
            raise ValueError(f"cells {self.cells} needs backend single (each cell one process); "
                             "fsdp2 cells joined by torchft are not built yet")
        return self


@dataclass(frozen=True)
class RunAsks:
    """What a run config asks of its trainer, as the layouts' gaps are checked against it."""

    mode: str
    lora: bool
    distill: bool
    agent: bool
    train: TrainSpec | None = None  # the run's ``train`` (None: the defaults)

    def features(self) -> set[str]:
        train = self.train or TrainSpec()
        return {name for name, on in (
            ("sft", self.mode != "rl"), ("lora", self.lora), ("distill", self.distill), ("agent", self.agent),
            ("ppo", train.estimator == "ppo"), ("ppo_epochs", train.ppo_epochs != 1),
        ) if on}


# per trainer layout, what it does not implement yet (a feature of RunAsks -> the reason)
LAYOUT_GAPS: dict[str, dict[str, str]] = {
    "fsdp2": {
        "sft": "mode sft (the cell trains the RL step only)",
        "lora": "model.lora (the cell shards full fine-tuning only)",
        "distill": "distill (the teacher is not sharded)",
        "ppo": "train.estimator ppo (the critic is not sharded)",
        "agent": "rollout.agent (multi-turn loss masks are not checked against the single trainer in a cell)",
    },
    "megatron": {  # and megatron_train_conflicts
        "sft": "mode sft (the megatron trainer trains the RL step only)",
        "lora": "model.lora (full fine-tuning only)",
        "distill": "distill (no teacher forward)",
        "agent": "rollout.agent (multi-turn loss masks are not checked against the single trainer)",
    },
    "cells": {  # trainer.cells > 1
        "sft": "mode sft (the cells train the RL step only)",
        "lora": "model.lora (a healed cell copies full weights only)",
        "distill": "distill (not tested across cells yet)",
        "ppo": "train.estimator ppo (the critic's grads are not reduced across cells)",
        "ppo_epochs": "train.ppo_epochs {ppo_epochs} (a step a cell loss interrupts is retried whole: one epoch)",
    },
}


def layout_conflicts(layout: str, asks: RunAsks) -> list[str]:
    """The settings of ``asks`` the trainer layout (``fsdp2``, ``megatron`` or ``cells``) does
    not implement yet, each with its reason."""
    have = asks.features()
    out = [reason.format(ppo_epochs=(asks.train or TrainSpec()).ppo_epochs)
           for feature, reason in LAYOUT_GAPS[layout].items() if feature in have]
    if layout == "megatron" and asks.train is not None:
        out += megatron_train_conflicts(asks.train)
    return out


def train_conflicts(layout: str, train: TrainSpec) -> list[str]:
    """The gaps of the trainer layout (``fsdp2``, ``megatron`` or ``cells``) that ``train``
    alone decides. ``set_hparams`` may change ``train`` mid-run, so each backend refuses them
    again at every step (the run config refused them before the run started)."""
    return layout_conflicts(layout, RunAsks(mode="rl", lora=False, distill=False, agent=False, train=train))


def megatron_train_conflicts(train: TrainSpec) -> list[str]:
    """The ``train`` knobs the megatron trainer's GRPO loss does not implement yet, set away
    from what it computes: refused by the run config, by ``set_hparams`` mid-run, and by the
    megatron trainer itself (``gpu_runtime.trainer.megatron.train``)."""
    out = []
    if train.kl_coef > 0:
        out.append("train.kl_coef > 0 (no frozen reference model is kept)")
    if train.entropy_coef > 0:
        out.append("train.entropy_coef > 0 (no entropy bonus in the loss)")
    if train.tis_cap is not None:
        out.append("train.tis_cap (no truncated importance sampling; off-policy rollout modes set it unless "
                   "tis_cap: null)")
    if train.ppo_epochs != 1:
        out.append(f"train.ppo_epochs {train.ppo_epochs} (one optimizer step per rollout)")
    if train.estimator == "ppo":
        out.append("train.estimator ppo (no critic)")
    if train.precision != "fp32":
        out.append(f"train.precision {train.precision} (the GPTModel trains in float32)")
    return out


__all__ = ["LAYOUT_GAPS", "RunAsks", "TrainerSpec", "layout_conflicts", "megatron_train_conflicts", "train_conflicts"]
