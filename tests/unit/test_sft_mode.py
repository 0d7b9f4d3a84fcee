"""SFT mode: the config rules, the trainer's supervised step (loss on the label tokens
only, micro-batch invariant, LoRA too), and ``SFTStep`` (or, in runs started before it,
``RLStep``) driving it without rollout or reward (real workflows on the time-skipping
server, stand-in activities)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from temporalio.client import WorkflowUpdateFailedError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from gpu_runtime.data.datasets import sft_target
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from gpu_runtime.trainer.policy.sft import sft_samples
from spec.run import RunConfig
from spec.train import HParamUpdate
from tests.unit.test_lora import LORA
from tests.unit.test_policy_trainer import ROWS, TOK, base, hparams
from tests.unit.workflow_harness import Cluster, finish, progress, run_config, scenario, start_run
from workflows.stubs import CHECKPOINT, COMPUTE_REWARDS_ON_NODE, ROLLOUT, TRAIN_STEP
from workflows.training_run import TrainingRun

SFT = {"mode": "sft", "sft": {"steps": 0, "batch_size": 5}}


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


# ---- config ----------------------------------------------------------------------------
def test_sft_mode_config() -> None:
    cfg = RunConfig.model_validate({**SFT, "train": {"lr": 1e-3, "warmup_steps": 2, "loss_agg": "seq_mean_token_mean"}})
    assert cfg.mode == "sft" and RunConfig().mode == "rl"
    bad = [
        ({"mode": "sft"}, "sft: steps is the warm-up before RL"),  # the warm-up's default 300
        ({**SFT, "train": {"kl_coef": 0.1}}, "train: kl_coef: RL loss knobs"),
        ({**SFT, "train": {"estimator": "rloo", "clip_eps": 0.1}}, "train: estimator, clip_eps"),
        ({**SFT, "reward": {"kind": "gsm8k"}}, "reward: the reward applies to mode rl"),
        ({**SFT, "rollout": {"group_size": 2, "dynamic_filter": {"enabled": True}}}, "rollout: dynamic_filter"),
        ({"mode": "dpo"}, "mode"),
    ]
    for raw, needle in bad:
        with pytest.raises(ValidationError) as err:
            RunConfig.model_validate(raw)
        assert needle in str(err.value).replace("\n  ", ": ").replace("Value error, ", ""), str(err.value)


# ---- the trainer's supervised step ------------------------------------------------------
def sft_trainer(lora: object = None) -> PolicyTrainer:
    return PolicyTrainer.create(base(7), hparams(kl_coef=0.0, ppo_epochs=1, warmup_steps=0, lr=3e-3), 7, lora)


def test_sft_step_trains_on_the_label_tokens_and_the_loss_falls() -> None:
    tr = sft_trainer()
    rows = ROWS[:8]
    losses = [tr.sft_step(rows, tr.hparams)["loss"] for _ in range(6)]
    assert tr.policy_version == 6 and tr.opt_steps == 6
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] * 0.9, losses
    m = tr.sft_step(rows, tr.hparams)
    labels = [len(TOK.encode(sft_target(r))) + 1 for r in rows]  # the answer and EOS; never the prompt
    assert m["tokens"] == sum(labels) and m["sft_rows"] == 8 and m["grad_norm"] > 0
    samples = sft_samples(TOK, rows, 0)
    assert [s.response_ids[-1] for s in samples] == [TOK.eos_token_id] * 8


def test_sft_step_is_micro_batch_invariant_and_deterministic() -> None:
    a, b, c = sft_trainer(), sft_trainer(), sft_trainer()
    ma = a.sft_step(ROWS[:6], hparams(kl_coef=0.0, ppo_epochs=1, micro_batch_size=6))
    mb = b.sft_step(ROWS[:6], hparams(kl_coef=0.0, ppo_epochs=1, micro_batch_size=1))
    mc = c.sft_step(ROWS[:6], hparams(kl_coef=0.0, ppo_epochs=1, micro_batch_size=6))
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-6) and ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-5)
    assert a.checksum() == c.checksum() and ma["loss"] == mc["loss"]


def test_sft_step_with_lora_trains_only_the_adapters() -> None:
    tr = sft_trainer(LORA)
    frozen = {n: p.detach().clone() for n, p in tr.model.named_parameters() if not p.requires_grad}
    losses = [tr.sft_step(ROWS[:8], tr.hparams)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, frozen[n]) for n, p in tr.model.named_parameters() if not p.requires_grad)


# ---- the workflow --------------------------------------------------------------------------
def test_sft_mode_steps_train_on_rows_without_rollout_or_reward() -> None:
    """An SFT run makes SFTStep children, which train on the dataset's rows: no rollout, no reward."""
    cluster = Cluster()
    held = cluster.gate(TRAIN_STEP, 2)

    async def body(env: WorkflowEnvironment, nodes: dict[str, Worker]) -> None:
        handle = await start_run(env, run_config(steps=3, **SFT))
        await held.wait_reached()
        with pytest.raises(WorkflowUpdateFailedError) as err:  # an RL knob, refused live too
            await handle.execute_update(TrainingRun.set_hparams, HParamUpdate(estimator="rloo"))
        assert "estimator" in str(err.value.cause)
        held.release.set()
        summary = await finish(handle)
        assert (summary.steps, summary.policy_version, summary.data_cursor) == (3, 3, 15)
        assert not cluster.served(ROLLOUT) and not cluster.served(COMPUTE_REWARDS_ON_NODE)
        assert [(t.batch.step, t.batch.policy_version, t.batch.chunk_keys, t.batch.sft.data_cursor, t.batch.sft.n_rows)
                for t in cluster.train_inputs if t.batch.sft] == [(1, 0, [], 0, 5), (2, 1, [], 5, 5), (3, 2, [], 10, 5)]
        assert [c.step for c in cluster.served(CHECKPOINT)] == [2, 3]  # checkpoints, evals: as in RL
        p = await progress(handle)
        assert [s.data_cursor for s in p.steps] == [5, 10, 15] and [s.loss for s in p.steps] == [1.0, 0.5, 1 / 3]
        assert [s.rollout_version for s in p.steps] == [0, 1, 2] and all(s.reward_mean == 0.0 for s in p.steps)
        for step in (1, 2, 3):
            child = await env.client.get_workflow_handle(f"{handle.id}/step-{step}").describe()
            assert child.workflow_type == "SFTStep"

    scenario(cluster, body)
