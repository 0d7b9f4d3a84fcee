"""PolicyTrainer.train_step with every estimator and loss knob: it trains, the
micro-batch split changes neither the loss nor the gradient, and the TIS / dual
clip / entropy / KL-in-reward numbers are what their formulas say."""

from __future__ import annotations

import copy
import math
from functools import cache

import pytest
import torch

from gpu_runtime.algorithms.logprobs import token_logprobs
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from gpu_runtime.trainer.common.batches import MicroBatch
from tests.unit.test_policy_trainer import METRICS, TOK, hparams, new_trainer, rollout

TERMS = ("loss", "pg_loss", "kl", "entropy", "clip_fraction")


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


@cache
def _base() -> PolicyTrainer:
    return new_trainer()  # kl_coef 0.1: keeps a reference model


def fresh() -> PolicyTrainer:
    return copy.deepcopy(_base())


ESTIMATOR_SETTINGS = {
    "grpo": {},
    "dr_grpo": dict(scale_adv_by_std=False, loss_agg="seq_mean_token_sum_norm", loss_agg_norm_len=8),
    "rloo": dict(estimator="rloo", dual_clip_c=3.0),
    "reinforce_pp": dict(estimator="reinforce_pp", kl_in_reward=True),
    "reinforce_pp_baseline": dict(estimator="reinforce_pp_baseline"),
    "gspo": dict(estimator="gspo", loss_agg="seq_mean_token_mean", clip_eps=3e-4, clip_eps_high=4e-4),
    "cispo": dict(estimator="cispo", clip_eps_high=4.0, entropy_coef=0.01, tis_cap=2.0),
    "ppo": dict(estimator="ppo", kl_in_reward=True, dual_clip_c=3.0, gamma=0.99, lam=0.9, critic_lr=1e-2),
}


@pytest.mark.parametrize("name", list(ESTIMATOR_SETTINGS))
def test_each_estimator_trains_with_finite_metrics(name: str) -> None:
    tr = fresh()
    before = tr.checksum()
    hp = hparams(**ESTIMATOR_SETTINGS[name])
    for step in range(2):
        m = tr.train_step(*rollout(step), group_size=4, hparams=hp)
        for k in METRICS:
            assert math.isfinite(m[k]), (name, k)
        assert 0.0 <= m["clip_fraction"] <= 1.0
    assert tr.checksum() != before and tr.policy_version == 2


SPLITS = [
    ("grpo", "token_mean", {}),
    ("rloo", "seq_mean_token_mean", dict(dual_clip_c=2.0)),
    ("reinforce_pp_baseline", "seq_mean_token_sum", dict(kl_in_reward=True)),
    ("cispo", "seq_mean_token_sum_norm", dict(loss_agg_norm_len=6, clip_eps_high=0.1)),
    ("gspo", "seq_mean_token_mean", {}),
    ("reinforce_pp", "token_mean", dict(entropy_coef=0.05, tis_cap=1.5, kl_estimator="k2")),
]


@pytest.mark.parametrize("estimator,loss_agg,extra", SPLITS, ids=[f"{e}-{a}" for e, a, _ in SPLITS])
def test_micro_batch_split_changes_neither_loss_nor_gradient(estimator: str, loss_agg: str, extra: dict) -> None:
    """One micro-batch per sample vs the whole batch in one: the same loss terms and
    the same gradient (left on the parameters after the step; grad_clip too large to act)."""
    results = []
    for mbs in (1, 8):
        tr = fresh()
        tr.train_step(*rollout(0), group_size=4, hparams=tr.hparams)  # so the policy differs from the reference
        hp = hparams(estimator=estimator, loss_agg=loss_agg, micro_batch_size=mbs, ppo_epochs=1, grad_clip=1e9,
                     **extra)
        m = tr.train_step(*rollout(1), group_size=4, hparams=hp)
        results.append((m, {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}))
    (m1, g1), (m8, g8) = results
    for k in TERMS:
        assert m1[k] == pytest.approx(m8[k], rel=1e-4, abs=1e-7), k
    assert g1.keys() == g8.keys() and g1
    for name in g1:
        assert torch.allclose(g1[name], g8[name], rtol=1e-3, atol=1e-7), name
    assert any(g.abs().sum() > 0 for g in g1.values())


def test_tis_weights_against_the_engine_logprobs() -> None:
    tr = fresh()
    samples, rewards = rollout(0)  # the engine logprobs are all -1.0
    batch = MicroBatch.of(samples, TOK.pad_token_id)
    with torch.no_grad():
        lp = token_logprobs(tr.model, batch.ids, batch.mask)[batch.tmask].tolist()
    weights = [min(math.exp(x + 1.0), 1.5) for x in lp]  # min(exp(trainer - engine), cap)
    m = tr.train_step(samples, rewards, group_size=4, hparams=hparams(tis_cap=1.5))
    assert m["tis_weight_mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-5)
    assert m["tis_clip_fraction"] == pytest.approx(sum(math.exp(x + 1.0) > 1.5 for x in lp) / len(lp))
    assert "tis_weight_mean" not in fresh().train_step(samples, rewards, group_size=4, hparams=hparams())
    for s in samples:
        s.logprobs = []
    with pytest.raises(ValueError, match="tis_cap needs the engine's logprob"):
        fresh().train_step(samples, rewards, group_size=4, hparams=hparams(tis_cap=1.5))


def test_entropy_bonus_and_kl_in_reward_enter_the_loss_as_documented() -> None:
    tr = fresh()
    m = tr.train_step(*rollout(0), group_size=4, hparams=hparams(ppo_epochs=1, kl_coef=0.0, entropy_coef=0.1))
    assert m["loss"] == pytest.approx(m["pg_loss"] - 0.1 * m["entropy"], abs=1e-6)
    plain = fresh()
    plain.train_step(*rollout(0), group_size=4, hparams=hparams(ppo_epochs=1, kl_coef=0.0))
    assert plain.checksum() != tr.checksum()

    tr = fresh()
    hp = hparams(ppo_epochs=1, kl_coef=0.1, kl_in_reward=True)
    tr.train_step(*rollout(0), group_size=4, hparams=hp)
    m = tr.train_step(*rollout(1), group_size=4, hparams=hp)  # the policy has moved off the reference
    assert m["kl"] > 0 and m["loss"] == m["pg_loss"]  # the KL is in the advantages, not in the loss


def test_dual_clip_fraction_is_reported_only_with_dual_clip() -> None:
    m = fresh().train_step(*rollout(0), group_size=4, hparams=hparams(dual_clip_c=1.5))
    assert 0.0 <= m["dual_clip_fraction"] <= 1.0
    assert "dual_clip_fraction" not in fresh().train_step(*rollout(0), group_size=4, hparams=hparams())
