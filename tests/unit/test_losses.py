"""Policy losses, KL estimators, truncated IS and loss aggregation against numbers
computed by hand (or by a plain-Python formula written out here)."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_runtime.algorithms.losses import (
    Aggregation,
    aggregate,
    cispo_per_token,
    gspo_per_token,
    kl_per_token,
    policy_loss_per_token,
    ppo_clip_per_token,
    tis_weights,
)

LN2 = math.log(2.0)


def approx(t: torch.Tensor, expected: list, tol: float = 1e-6) -> bool:
    return torch.allclose(t.detach().double(), torch.tensor(expected, dtype=torch.float64), atol=tol, rtol=0)


# ---- PPO clip and dual clip ---------------------------------------------------------
def test_ppo_dual_clip_caps_negative_advantages_only() -> None:
    old = torch.zeros(1, 4)
    # ratios 4 (A=-1), 1.5 (A=-1), 4 (A=+1), 0.5 (A=-1); clip 0.2, dual clip c = 3
    lp = torch.log(torch.tensor([[4.0, 1.5, 4.0, 0.5]])).requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]])
    plain = ppo_clip_per_token(lp, old, adv, clip_eps=0.2)
    # max(-A r, -A clamp(r)): 4 | 1.5 | max(-4, -1.2) = -1.2 | max(.5, .8) = .8
    assert approx(plain.loss, [4.0, 1.5, -1.2, 0.8])
    assert plain.clipped.tolist() == [[False, False, True, True]] and plain.dual_clipped is None
    dual = ppo_clip_per_token(lp, old, adv, clip_eps=0.2, dual_clip_c=3.0)
    # A < 0: min(loss, -A c = 3) -> 3 | 1.5 | (A > 0 untouched) -1.2 | .8
    assert approx(dual.loss, [3.0, 1.5, -1.2, 0.8])
    assert dual.dual_clipped is not None and dual.dual_clipped.tolist() == [[True, False, False, False]]
    dual.loss.sum().backward()
    # d/dlp of -A r = -A r: token 1 is capped (constant 3) -> 0; token 2: 1.5; tokens 3, 4 clipped -> 0
    assert lp.grad is not None and approx(lp.grad, [[0.0, 1.5, 0.0, 0.0]])
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        ppo_clip_per_token(lp, old, adv, clip_eps=0.2, dual_clip_c=1.0)


# ---- GSPO ---------------------------------------------------------------------------
def test_gspo_sequence_ratio_clip_and_gradient() -> None:
    old = torch.zeros(2, 3)
    # sequence 0: log-ratios .1, .3 (third token masked, its 5.0 must not count) -> s = exp(.2)
    # sequence 1: log-ratios -.2, -.4, -.6 -> s = exp(-.4)
    lp = torch.tensor([[0.1, 0.3, 5.0], [-0.2, -0.4, -0.6]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    s0, s1 = math.exp(0.2), math.exp(-0.4)  # 1.2214028, 0.6703200
    assert s1 < 0.8  # so seq 1 clips
    # A = -1 for both; clip .2: seq 0 -> max(s0, 1.2) = s0 (unclipped); seq 1 -> max(s1, .8) = .8 (clipped)
    t = gspo_per_token(lp, old, torch.tensor([-1.0, -1.0]), mask, clip_eps=0.2)
    assert approx(t.loss[0, :2], [s0, s0]) and approx(t.loss[1], [0.8, 0.8, 0.8])
    assert t.clipped[0, :2].tolist() == [False, False] and t.clipped[1].tolist() == [True, True, True]
    loss = aggregate(t.loss, mask, "seq_mean_token_mean")
    assert loss.item() == pytest.approx((s0 + 0.8) / 2, abs=1e-6)
    loss.backward()
    # the sequence objective -A s_i / 2 sequences: d/dlp_t = s_i * (1/|y_i|) / 2 for seq 0, 0 for the clipped seq 1
    assert lp.grad is not None and approx(lp.grad, [[s0 / 4, s0 / 4, 0.0], [0.0, 0.0, 0.0]])


def test_gspo_small_clip_ranges_of_the_paper() -> None:
    lp = torch.tensor([[0.1, 0.3]])
    t = gspo_per_token(lp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool),
                       clip_eps=3e-4, clip_eps_high=4e-4)
    # s = exp(.2) > 1.0004: for A > 0 the clipped term -1.0004 is the larger
    assert approx(t.loss, [[-1.0004, -1.0004]]) and bool(t.clipped.all())


# ---- CISPO --------------------------------------------------------------------------
def test_cispo_clipped_stop_gradient_weight_keeps_gradient() -> None:
    old = torch.full((1, 3), -1.0)
    ratios = [1.5, 0.5, 6.0]
    lp = (old + torch.log(torch.tensor([ratios]))).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -2.0]])
    t = cispo_per_token(lp, old, adv, clip_eps_high=0.28)
    # w = min(r, 1.28) = [1.28, .5, 1.28] (no lower bound); loss = -w A lp
    w = [1.28, 0.5, 1.28]
    lps = [-1.0 + math.log(r) for r in ratios]
    assert approx(t.loss, [[-w[0] * 1.0 * lps[0], -w[1] * 1.0 * lps[1], -w[2] * -2.0 * lps[2]]])
    assert t.clipped.tolist() == [[True, False, True]]
    t.loss.sum().backward()
    # gradient -w A through logprobs only, also on the truncated tokens
    assert lp.grad is not None and approx(lp.grad, [[-1.28, -0.5, 2.56]])


def test_policy_loss_dispatch() -> None:
    lp, old = torch.log(torch.tensor([[3.0]])), torch.zeros(1, 1)
    adv, mask = torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool)
    # cispo's cap falls back to clip_eps: min(3, 1.5) * 1 * ln 3
    t = policy_loss_per_token("cispo", lp, old, adv, mask, clip_eps=0.5)
    assert approx(t.loss, [[-1.5 * math.log(3.0)]])
    for est in ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        assert approx(policy_loss_per_token(est, lp, old, adv, mask, clip_eps=0.5).loss, [[-1.5]])
    assert approx(policy_loss_per_token("gspo", lp, old, adv, mask, clip_eps=0.5).loss, [[-1.5]])


# ---- KL, truncated IS ---------------------------------------------------------------
def test_kl_estimators_by_hand() -> None:
    lp, ref = torch.tensor([[math.log(0.5), 0.0]]), torch.tensor([[0.0, 0.0]])
    # d = ref - lp = ln 2: k1 = -ln 2, k2 = (ln 2)^2 / 2, k3 = 2 - ln 2 - 1
    assert approx(kl_per_token(lp, ref, "k1"), [[-LN2, 0.0]])
    assert approx(kl_per_token(lp, ref, "k2"), [[LN2 * LN2 / 2, 0.0]])
    assert approx(kl_per_token(lp, ref, "k3"), [[1.0 - LN2, 0.0]])
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_per_token(lp, ref, "k4")


def test_tis_weights_are_truncated_and_detached() -> None:
    old = torch.zeros(1, 3, requires_grad=True)
    engine = torch.tensor([[0.0, LN2, -math.log(4.0)]])
    w, clipped = tis_weights(old, engine, cap=2.0)
    # exp(old - engine) = [1, .5, 4] -> min(., 2)
    assert approx(w, [[1.0, 0.5, 2.0]]) and clipped.tolist() == [[False, False, True]]
    assert not w.requires_grad


# ---- aggregation --------------------------------------------------------------------
X = [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]]
MASK = [[True, True, True], [True, False, False], [False, False, False]]  # the last sample is fully masked
EXPECTED = {
    "token_mean": (1 + 2 + 3 + 4) / 4,  # 2.5
    "seq_mean_token_mean": ((1 + 2 + 3) / 3 + 4 / 1) / 2,  # 3.0: the masked sample does not count
    "seq_mean_token_sum": ((1 + 2 + 3) + 4) / 2,  # 5.0
    "seq_mean_token_sum_norm": ((1 + 2 + 3) + 4) / 2 / 4,  # 1.25 with norm_len 4
}
# d loss / d x[i][t] on unmasked tokens
EXPECTED_GRAD = {
    "token_mean": [[0.25] * 3, [0.25, 0, 0], [0, 0, 0]],
    "seq_mean_token_mean": [[1 / 6] * 3, [0.5, 0, 0], [0, 0, 0]],
    "seq_mean_token_sum": [[0.5] * 3, [0.5, 0, 0], [0, 0, 0]],
    "seq_mean_token_sum_norm": [[0.125] * 3, [0.125, 0, 0], [0, 0, 0]],
}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_aggregation_by_hand_and_micro_batch_split_invariance(mode: str) -> None:
    mask = torch.tensor(MASK)
    whole = torch.tensor(X, requires_grad=True)
    loss = aggregate(whole, mask, mode, norm_len=4)
    assert loss.item() == pytest.approx(EXPECTED[mode])
    loss.backward()
    assert whole.grad is not None and approx(whole.grad, EXPECTED_GRAD[mode])
    # micro-batches of 1 sample (the last one fully masked) and of 2 + 1: the shares add up to the same
    for split in ([1, 1, 1], [2, 1], [1, 2]):
        x = torch.tensor(X, requires_grad=True)
        agg = Aggregation.over(torch.split(mask, split), mode, norm_len=4)
        total = sum(agg(xs, ms) for xs, ms in zip(torch.split(x, split), torch.split(mask, split)))
        assert isinstance(total, torch.Tensor) and total.item() == pytest.approx(EXPECTED[mode])
        total.backward()
        assert x.grad is not None and approx(x.grad, EXPECTED_GRAD[mode])


def test_aggregation_empty_mask_and_bad_settings() -> None:
    x, none = torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.bool)
    for mode in EXPECTED:
        agg = Aggregation.over([none], mode, norm_len=4)
        assert agg.value(x, none).item() == 0.0 and agg.weight(none) == 0.0
    with pytest.raises(ValueError, match="norm_len"):
        Aggregation.over([none], "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="loss_agg must be one of"):
        Aggregation.over([none], "sum")
