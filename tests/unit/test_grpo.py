"""GRPO math against numbers computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from gpu_runtime.algorithms.grpo import entropy_from_logits, group_advantages, kl_k3, ppo_clip_loss, token_logprobs
from tests.engine_fixtures import tiny_model


def test_group_advantages_two_groups() -> None:
    # group [1, 0]: mean .5, std .5 -> [1, -1]; group [0, 1] -> [-1, 1]
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2, eps=0.0)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0]))


def test_group_advantages_uniform_group_is_zero_and_unscaled_variant() -> None:
    adv = group_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]), group_size=3)
    assert torch.equal(adv, torch.zeros(6))
    # rewards [1, 0, 0, 0]: mean .25 -> [.75, -.25, -.25, -.25]; std = sqrt(.1875) = .4330127
    a = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, scale_by_std=False)
    assert torch.allclose(a, torch.tensor([0.75, -0.25, -0.25, -0.25]))
    s = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), group_size=4, eps=0.0)
    assert torch.allclose(s, torch.tensor([0.75, -0.25, -0.25, -0.25]) / 0.4330127, atol=1e-6)


def test_group_advantages_rejects_bad_size() -> None:
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.tensor([1.0, 0.0, 1.0]), group_size=2)


def test_ppo_clip_loss_ratio_one_is_minus_mean_advantage() -> None:
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
    mask = torch.tensor([[True, True], [True, False]])
    loss, clip = ppo_clip_loss(lp, lp.clone(), torch.tensor([1.0, -1.0]), mask, clip_eps=0.2)
    # tokens: A = 1, 1, -1 -> loss = -(1 + 1 - 1) / 3
    assert loss.item() == pytest.approx(-1.0 / 3.0)
    assert clip.item() == 0.0


def test_ppo_clip_loss_clipping_by_hand() -> None:
    old = torch.zeros(1, 4)
    # ratios: 1.5 (A=+1 -> clipped at 1.2), 0.5 (A=+1 -> unclipped, min is .5),
    #         1.5 (A=-1 -> unclipped, -A*r = 1.5), 0.5 (A=-1 -> clipped at .8)
    lp = torch.log(torch.tensor([[1.5, 0.5, 1.5, 0.5]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, clip = ppo_clip_loss(lp, old, adv, mask, clip_eps=0.2)
    expected = (-1.2 + -0.5 + 1.5 + 0.8) / 4  # = 0.15
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert clip.item() == pytest.approx(0.5)
    # clip-higher: upper bound 1.28 -> first token -1.28
    loss_h, _ = ppo_clip_loss(lp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    assert loss_h.item() == pytest.approx((-1.28 - 0.5 + 1.5 + 0.8) / 4, abs=1e-6)


def test_ppo_clip_loss_gradient_at_ratio_one() -> None:
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = ppo_clip_loss(lp, lp.detach(), torch.tensor([2.0]), torch.ones(1, 2, dtype=torch.bool), 0.2)
    loss.backward()
    assert lp.grad is not None
    assert torch.allclose(lp.grad, torch.tensor([[-1.0, -1.0]]))  # -A / n_tokens


def test_kl_k3_known_values() -> None:
    lp = torch.tensor([[0.0, math.log(0.5), -1.0]])
    ref = torch.tensor([[0.0, 0.0, -1.0]])
    mask = torch.tensor([[True, True, False]])
    # d = [0, ln 2]: k3 = [0, 2 - ln2 - 1] -> mean over 2 tokens
    assert kl_k3(lp, ref, mask).item() == pytest.approx((1.0 - math.log(2.0)) / 2.0, abs=1e-6)
    assert kl_k3(ref, ref, torch.ones(1, 3, dtype=torch.bool)).item() == 0.0


def test_entropy_from_logits_uniform_and_peaked() -> None:
    ent = entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]))
    assert ent[0].item() == pytest.approx(math.log(4.0), abs=1e-6)
    assert ent[1].item() == pytest.approx(0.0, abs=1e-6)


def test_token_logprobs_right_padding_matches_unpadded() -> None:
    torch.manual_seed(0)
    model = tiny_model(seed=1)[0]
    a = torch.tensor([[1, 5, 6, 7, 8]])
    b = torch.tensor([[1, 9, 4, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    lp = token_logprobs(model, torch.cat([a, b]), mask)
    assert lp.shape == (2, 4)
    alone = token_logprobs(model, b[:, :3], mask[1:, :3])
    assert torch.allclose(lp[1, :2], alone[0], atol=1e-5)
    # direct check of the first entry
    logits = model(a).logits  # transformers' own forward, no mask or positions of ours
    assert lp[0, 0].item() == pytest.approx(torch.log_softmax(logits[0, 0], -1)[5].item(), abs=1e-5)
