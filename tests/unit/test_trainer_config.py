"""The ``trainer`` section: backend single | fsdp2 | megatron, ranks_per_cell, and what fsdp2 and megatron
refuse up front."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from spec.run import RunConfig
from spec.strict import format_validation_error

# 4 prompts x 4 samples in micro-batches of 4: 4 micro-batches
BASE = {"rollout": {"prompts_per_step": 4, "group_size": 4}, "train": {"micro_batch_size": 4}}


def error(cfg: dict) -> str:
    with pytest.raises(ValidationError) as info:
        RunConfig.model_validate(cfg)
    return format_validation_error(info.value)


def test_defaults_are_one_process() -> None:
    t = RunConfig().trainer
    assert (t.backend, t.ranks_per_cell, t.placement, t.ray_address, t.collective_timeout_s) == (
        "single", 1, "strict_pack", None, 120.0)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_fsdp2_cells_that_divide_the_micro_batches(ranks: int) -> None:
    cfg = RunConfig.model_validate({**BASE, "trainer": {"backend": "fsdp2", "ranks_per_cell": ranks}})
    assert cfg.trainer.ranks_per_cell == ranks


@pytest.mark.parametrize("cfg,message", [
    ({"trainer": {"ranks_per_cell": 2}}, "trainer: ranks_per_cell 2 needs backend fsdp2"),
    ({"trainer": {"backend": "fsdp2", "ranks_per_cell": 0}}, "trainer.ranks_per_cell: Input should be greater than"),
    ({"trainer": {"backend": "fsdp3"}}, "trainer.backend: Input should be 'single', 'fsdp2' or 'megatron'"),
    ({**BASE, "trainer": {"backend": "fsdp2", "ranks_per_cell": 3}}, "ranks_per_cell 3 must divide the step's 4 micro-batches"),
    ({"trainer": {"backend": "fsdp2", "ranks_per_cell": 2}}, "must divide the step's 1 micro-batches"),
    ({"trainer": {"placement": "spread"}}, "trainer: placement and ray_address need backend fsdp2"),
    ({"trainer": {"ray_address": "10.0.0.1:6379"}}, "trainer: placement and ray_address need backend fsdp2"),
    ({**BASE, "trainer": {"backend": "fsdp2", "placement": "pack"}}, "trainer.placement: Input should be 'strict_pack' or 'spread'"),
    ({**BASE, "trainer": {"backend": "fsdp2", "collective_timeout_s": 0}}, "trainer.collective_timeout_s: Input should be greater than 0"),
    ({**BASE, "trainer": {"backend": "fsdp2"}, "train": {"micro_batch_size": 4, "estimator": "ppo"}},
     "does not support train.estimator ppo"),
    ({**BASE, "trainer": {"backend": "fsdp2"}, "model": {"path": "/m", "lora": {"r": 4}}}, "does not support model.lora"),
    ({**BASE, "trainer": {"backend": "fsdp2"}, "distill": {"teacher_path": "/t"}}, "does not support distill"),
    ({"mode": "sft", "sft": {"steps": 0}, "trainer": {"backend": "fsdp2"}}, "does not support mode sft"),
])
def test_bad_trainer_sections_name_the_field(cfg: dict, message: str) -> None:
    assert message in error(cfg)


def test_one_step_off_keeps_its_tis_cap_in_a_cell() -> None:
    cfg = RunConfig.model_validate({**BASE, "trainer": {"backend": "fsdp2", "ranks_per_cell": 2, "placement": "spread",
                                                        "ray_address": "127.0.0.1:6379", "collective_timeout_s": 30},
                                    "rollout": {"mode": "one_step_off", "prompts_per_step": 4, "group_size": 4}})
    assert cfg.train.tis_cap is not None
    assert (cfg.trainer.placement, cfg.trainer.ray_address, cfg.trainer.collective_timeout_s) == (
        "spread", "127.0.0.1:6379", 30)


def test_one_step_off_with_tis_off_is_accepted() -> None:
    cfg = RunConfig.model_validate({**BASE, "trainer": {"backend": "fsdp2", "ranks_per_cell": 2},
                                    "rollout": {"mode": "one_step_off", "prompts_per_step": 4, "group_size": 4},
                                    "train": {"micro_batch_size": 4, "tis_cap": None}})
    assert cfg.train.tis_cap is None


# ---- backend megatron: what its trainer does not implement is refused before the run, by field
MEGATRON = {"trainer": {"backend": "megatron"}}


def test_megatron_with_the_grpo_defaults_is_accepted() -> None:
    cfg = RunConfig.model_validate({**BASE, **MEGATRON, "train": {"micro_batch_size": 4, "estimator": "rloo",
                                                                  "warmup_steps": 3, "lr": 1e-5}})
    assert cfg.trainer.backend == "megatron" and cfg.trainer.ranks_per_cell == 1 and cfg.trainer.cells == 1


@pytest.mark.parametrize("cfg,message", [
    ({"trainer": {"backend": "megatron", "ranks_per_cell": 2}},
     "trainer: ranks_per_cell 2: backend megatron runs one process (tensor/pipeline parallel ranks are not built yet)"),
    ({"trainer": {"backend": "megatron", "cells": 2}}, "trainer: cells 2: backend megatron runs one cell"),
    ({"trainer": {"backend": "megatron", "placement": "spread"}}, "placement and ray_address need backend fsdp2"),
    ({**MEGATRON, "train": {"kl_coef": 0.1}}, "backend megatron does not support train.kl_coef > 0"),
    ({**MEGATRON, "train": {"entropy_coef": 0.01}}, "does not support train.entropy_coef > 0"),
    ({**MEGATRON, "train": {"tis_cap": 2.0}}, "does not support train.tis_cap"),
    ({**MEGATRON, "rollout": {"mode": "one_step_off"}}, "train.tis_cap (no truncated importance sampling; off-policy"),
    ({**MEGATRON, "train": {"ppo_epochs": 2}}, "does not support train.ppo_epochs 2"),
    ({**MEGATRON, "train": {"estimator": "ppo"}}, "does not support train.estimator ppo (no critic)"),
    ({**MEGATRON, "model": {"path": "/m", "lora": {"r": 4}}}, "does not support model.lora"),
    ({**MEGATRON, "distill": {"teacher_path": "/t"}}, "does not support distill"),
    ({**MEGATRON, "mode": "sft", "sft": {"steps": 0}}, "does not support mode sft"),
    ({**MEGATRON, "data": {"kind": "tool_arithmetic"}, "rollout": {"agent": {}}, "eval": {"enabled": False}},
     "does not support rollout.agent"),
])
def test_megatron_refuses_what_it_does_not_implement_by_field(cfg: dict, message: str) -> None:
    assert message in error(cfg)


def test_megatron_lists_every_conflict_at_once() -> None:
    msg = error({**MEGATRON, "train": {"kl_coef": 0.1, "ppo_epochs": 2}})
    assert msg.startswith("trainer: backend megatron does not support") and "kl_coef" in msg and "ppo_epochs 2" in msg


def test_off_policy_megatron_runs_with_tis_off() -> None:
    cfg = RunConfig.model_validate({**MEGATRON, "rollout": {"mode": "one_step_off"}, "train": {"tis_cap": None}})
    assert cfg.train.tis_cap is None


@pytest.mark.parametrize("knob,value", [("kl_coef", 0.1), ("entropy_coef", 0.01), ("tis_cap", 2.0),
                                        ("ppo_epochs", 2), ("estimator", "ppo"), ("precision", "bf16")])
def test_the_config_and_the_megatron_loss_refuse_the_same_knobs(knob: str, value: object) -> None:
    """One check (``megatron_train_conflicts``, torch-free) refuses the knobs in the run config,
    and in the megatron loss the trainer runs every step (``set_hparams`` may change them)."""
    from gpu_runtime.trainer.megatron.train import grpo_backward
    from spec.train import TrainSpec
    from spec.trainer import megatron_train_conflicts

    train = TrainSpec.model_validate({knob: value})
    assert megatron_train_conflicts(TrainSpec()) == []
    (reason,) = megatron_train_conflicts(train)
    assert knob in reason
    with pytest.raises(ValueError, match=re.escape(reason)):
        grpo_backward(None, [], [], 4, train, 0)  # refused before the model is touched

def test_the_backends_refuse_mid_run_the_train_knobs_their_layout_lacks() -> None:
    """``train_conflicts``: what the fsdp2 ranks, the DP cells and the megatron trainer refuse at
    every step (``set_hparams`` may change ``train``), from the same table the config reads."""
    from spec.train import TrainSpec
    from spec.trainer import LAYOUT_GAPS, megatron_train_conflicts, train_conflicts

    ppo = TrainSpec(estimator="ppo")
    assert train_conflicts("fsdp2", ppo) == [LAYOUT_GAPS["fsdp2"]["ppo"]]
    assert train_conflicts("cells", ppo.model_copy(update={"ppo_epochs": 2})) == [
        LAYOUT_GAPS["cells"]["ppo"], LAYOUT_GAPS["cells"]["ppo_epochs"].format(ppo_epochs=2)]
    assert train_conflicts("megatron", ppo) == megatron_train_conflicts(ppo)
    assert all(train_conflicts(layout, TrainSpec()) == [] for layout in LAYOUT_GAPS)
