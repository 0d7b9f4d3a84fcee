"""Advantage estimators against numbers computed by hand (or by a plain-Python
formula written out here, independent of the implementation)."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_runtime.algorithms.advantages import (
    WHITEN_EPS,
    compute_advantages,
    group_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    token_returns,
)


def lens_mask(lens: list[int]) -> torch.Tensor:
    width = max(lens)
    return torch.tensor([[t < n for t in range(width)] for n in lens])


def whiten(values: list[float]) -> list[float]:
    """Plain Python: (v - mean) / sqrt(population variance + eps)."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return [(v - mean) / math.sqrt(var + WHITEN_EPS) for v in values]


def tokens(adv: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The response-token entries row by row (what the whitening sees)."""
    return adv[mask].tolist()


# ---- RLOO ---------------------------------------------------------------------------
def test_rloo_leave_one_out_by_hand() -> None:
    # group [3, 1, 2]: 3 - (1+2)/2 = 1.5, 1 - (3+2)/2 = -1.5, 2 - (3+1)/2 = 0
    # group [0, 0, 1]: 0 - .5, 0 - .5, 1 - 0
    adv = rloo_advantages(torch.tensor([3.0, 1.0, 2.0, 0.0, 0.0, 1.0]), group_size=3)
    assert adv.tolist() == pytest.approx([1.5, -1.5, 0.0, -0.5, -0.5, 1.0])


def test_rloo_edge_cases() -> None:
    assert rloo_advantages(torch.tensor([0.7, 0.7, 0.7, 0.7]), group_size=4).tolist() == [0.0] * 4  # all equal
    assert rloo_advantages(torch.tensor([1.0, 0.0, 5.0]), group_size=1).tolist() == [0.0] * 3  # one per group
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(torch.tensor([1.0, 0.0, 1.0]), group_size=2)


# ---- GRPO through the dispatcher -----------------------------------------------------
def test_grpo_broadcast_over_response_tokens() -> None:
    mask = lens_mask([2, 1, 3, 1])
    adv = compute_advantages("grpo", torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, mask)
    a = 0.75 / math.sqrt(0.1875)  # (1 - .25) / population std of [1, 0, 0, 0]
    b = -0.25 / math.sqrt(0.1875)
    assert torch.allclose(adv, torch.tensor([[a, a, 0], [b, 0, 0], [b, b, b], [b, 0, 0]]), atol=1e-5)
    # Dr.GRPO: no std; gspo and cispo use the same advantages
    dr = compute_advantages("grpo", torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, mask, scale_by_std=False)
    assert dr[:, 0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    for est in ("gspo", "cispo"):
        assert torch.equal(compute_advantages(est, torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, mask), adv)
    assert torch.equal(group_advantages(torch.ones(4), 2), torch.zeros(4))  # all equal -> 0


def test_kl_in_reward_for_sequence_estimators() -> None:
    # rewards [1, 1], token KL sums .2 and .6, kl_coef 1 -> sequence rewards [.8, .4]
    mask = lens_mask([2, 3])
    kl = torch.tensor([[0.1, 0.1, 99.0], [0.2, 0.2, 0.2]])  # 99 is past the first response: ignored
    r = torch.tensor([1.0, 1.0])
    dr = compute_advantages("grpo", r, 2, mask, scale_by_std=False, token_kl=kl, kl_coef=1.0)
    assert tokens(dr, mask) == pytest.approx([0.2, 0.2, -0.2, -0.2, -0.2])
    rloo = compute_advantages("rloo", r, 2, mask, token_kl=kl, kl_coef=1.0)  # .8 - .4, .4 - .8
    assert tokens(rloo, mask) == pytest.approx([0.4, 0.4, -0.4, -0.4, -0.4])
    # without kl_coef the KL is ignored: equal rewards -> 0
    assert compute_advantages("rloo", r, 2, mask, token_kl=kl, kl_coef=0.0).abs().sum().item() == 0.0


# ---- REINFORCE++ --------------------------------------------------------------------
def test_token_returns_with_kl_by_hand() -> None:
    mask = lens_mask([3, 2])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]])  # 9.0 is padding
    g = token_returns(torch.tensor([1.0, 0.0]), mask, kl, kl_coef=0.5)
    # G_t = r - .5 * sum_{s >= t} kl_s: [1 - .3, 1 - .25, 1 - .15], [0 - .5, 0 - .25]
    assert torch.allclose(g, torch.tensor([[0.7, 0.75, 0.85], [-0.5, -0.25, 0.0]]), atol=1e-6)


def test_reinforce_pp_whitens_over_the_batch() -> None:
    mask = lens_mask([3, 2])
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask)
    # tokens [1, 1, 1, 0, 0]: mean .6, variance .24 -> .4 / .4898979 = .8164966, -.6 / .4898979 = -1.2247449
    assert tokens(adv, mask) == pytest.approx([0.8164966, 0.8164966, 0.8164966, -1.2247449, -1.2247449], abs=1e-6)
    assert adv[1, 2].item() == 0.0
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 9.0]])
    with_kl = compute_advantages("reinforce_pp", torch.tensor([1.0, 0.0]), 1, mask, token_kl=kl, kl_coef=0.5)
    assert tokens(with_kl, mask) == pytest.approx(whiten([0.7, 0.75, 0.85, -0.5, -0.25]), abs=1e-6)


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens() -> None:
    # groups [1, 0] and [1, 1], response lengths 2, 1, 1, 2 -> centred .5, -.5, 0, 0 per token
    mask = lens_mask([2, 1, 1, 2])
    adv = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, mask)
    assert tokens(adv, mask) == pytest.approx(whiten([0.5, 0.5, -0.5, 0.0, 0.0, 0.0]), abs=1e-6)
    # the same through the dispatcher, with KL in the reward: token returns minus the group mean reward
    kl = torch.tensor([[0.2, 0.4], [0.6, 0.0], [0.0, 0.0], [0.2, 0.2]])
    got = compute_advantages("reinforce_pp_baseline", torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, mask,
                             token_kl=kl, kl_coef=1.0)
    # G: [1 - .6, 1 - .4], [0 - .6], [1], [1 - .4, 1 - .2]; baselines .5, .5, 1, 1
    assert tokens(got, mask) == pytest.approx(whiten([-0.1, 0.1, -1.1, 0.0, -0.4, -0.2]), abs=1e-6)


def test_reinforce_pp_edge_cases() -> None:
    mask = lens_mask([2, 3, 1, 2])
    equal = torch.full((4,), 0.5)
    assert compute_advantages("reinforce_pp", equal, 2, mask).abs().max().item() == 0.0  # all equal
    assert compute_advantages("reinforce_pp_baseline", equal, 2, mask).abs().max().item() == 0.0
    # one sample per group: its own mean is the baseline -> 0
    one = compute_advantages("reinforce_pp_baseline", torch.tensor([1.0, 0.0, 3.0, 2.0]), 1, mask)
    assert one.abs().max().item() == 0.0


def test_fully_masked_sequence_gets_zero_and_does_not_move_the_statistics() -> None:
    mask = lens_mask([3, 2, 0])  # the third sample has no response token
    r = torch.tensor([1.0, 0.0, 100.0])
    adv = reinforce_pp_advantages(r, mask)
    assert adv[2].abs().sum().item() == 0.0
    assert tokens(adv, mask) == pytest.approx(whiten([1.0, 1.0, 1.0, 0.0, 0.0]), abs=1e-6)
    grpo = compute_advantages("grpo", r, 3, mask, scale_by_std=False)
    assert grpo[2].abs().sum().item() == 0.0


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="estimator must be one of"):
        compute_advantages("a2c", torch.ones(2), 2, lens_mask([1, 1]))
    with pytest.raises(ValueError, match="needs the critic's values"):  # ppo: gae.gae_advantages_and_returns
        compute_advantages("ppo", torch.ones(2), 2, lens_mask([1, 1]))
    with pytest.raises(ValueError, match="mask must be"):
        compute_advantages("grpo", torch.ones(2), 2, lens_mask([1, 1, 1]))
