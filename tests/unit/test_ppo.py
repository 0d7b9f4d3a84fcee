"""PPO with a critic: GAE and the clipped value loss against plain Python written
here, one whole trainer step against a one-process plain-torch reference, and the
critic's life cycle (created from the policy, checkpointed bitwise, never published)."""

from __future__ import annotations

import copy
import functools
import math
import random
from pathlib import Path

import pytest
import torch

from gpu_runtime.algorithms.gae import (
    explained_variance,
    gae_advantages_and_returns,
    token_level_rewards,
    value_loss_per_token,
)
from gpu_runtime.algorithms.advantages import compute_advantages
from gpu_runtime.algorithms.losses import kl_per_token
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from gpu_runtime.trainer.policy.critic import CRITIC_OPTIM, CRITIC_WEIGHTS
from tests.unit.test_policy_trainer import hparams, new_trainer, rollout


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


def close(got: torch.Tensor, want: list, atol: float = 1e-6) -> None:
    torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), rtol=0, atol=atol)


# ---- plain Python references ----------------------------------------------------------
def gae_reference(rewards: list[list[float]], values: list[list[float]], mask: list[list[bool]],
                  gamma: float, lam: float) -> tuple[list[list[float]], list[list[float]]]:
    """GAE over each sample's real tokens only, written from the paper's definition:
    delta_t = r_t + gamma V_next - V_t, A_t = sum_k (gamma lam)^k delta_{t+k}."""
    advs, rets = [], []
    for r, v, m in zip(rewards, values, mask):
        idx = [t for t in range(len(m)) if m[t]]
        deltas = []
        for j, t in enumerate(idx):
            v_next = v[idx[j + 1]] if j + 1 < len(idx) else 0.0
            deltas.append(r[t] + gamma * v_next - v[t])
        a_row, g_row = [0.0] * len(m), [0.0] * len(m)
        for j, t in enumerate(idx):
            a = sum((gamma * lam) ** k * deltas[j + k] for k in range(len(idx) - j))
            a_row[t], g_row[t] = a, a + v[t]
        advs.append(a_row)
        rets.append(g_row)
    return advs, rets


def whiten_reference(x: list[list[float]], mask: list[list[bool]]) -> list[list[float]]:
    vals = [x[i][t] for i in range(len(x)) for t in range(len(x[i])) if mask[i][t]]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / len(vals)
    return [[(x[i][t] - mean) / math.sqrt(var + 1e-8) if mask[i][t] else 0.0 for t in range(len(x[i]))]
            for i in range(len(x))]


def _random_case(seed: int, n: int = 4, width: int = 6, holes: bool = False) -> tuple:
    rng = random.Random(seed)
    lens = [rng.randint(1, width) for _ in range(n)]
    lens[0] = 1  # a one-token response
    mask = [[t < lens[i] for t in range(width)] for i in range(n)]
    if holes:  # masked tokens inside a response (e.g. a tool's output) are skipped
        for i in range(n):
            if lens[i] >= 3:
                mask[i][1] = False
    rewards = [[rng.uniform(-1, 1) for _ in range(width)] for _ in range(n)]
    values = [[rng.uniform(-1, 1) for _ in range(width)] for _ in range(n)]
    return rewards, values, mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (1.0, 0.0), (0.5, 1.0)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_the_reference(gamma: float, lam: float, holes: bool) -> None:
    rewards, values, mask = _random_case(3, holes=holes)
    adv, ret = gae_advantages_and_returns(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask),
                                          gamma, lam, whiten=False)
    ref_adv, ref_ret = gae_reference(rewards, values, mask, gamma, lam)
    close(adv, ref_adv, 1e-5)
    close(ret, ref_ret, 1e-5)
    white, _ = gae_advantages_and_returns(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), gamma, lam)
    close(white, whiten_reference(ref_adv, mask), 1e-4)


def test_gamma_one_lam_one_is_reward_to_go_minus_value() -> None:
    r = [[0.0, 0.5, 2.0], [1.0, 0.0, 0.0]]
    v = [[0.3, -0.2, 0.7], [0.4, 9.0, 9.0]]  # values past the response are ignored
    m = [[True, True, True], [True, False, False]]
    adv, ret = gae_advantages_and_returns(torch.tensor(r), torch.tensor(v), torch.tensor(m), 1.0, 1.0, whiten=False)
    close(ret, [[2.5, 2.5, 2.0], [1.0, 0.0, 0.0]])
    close(adv, [[2.2, 2.7, 1.3], [0.6, 0.0, 0.0]])


def test_one_token_responses_and_gamma_lam_by_hand() -> None:
    # one token: A = r - V whatever gamma and lam
    adv, ret = gae_advantages_and_returns(torch.tensor([[1.0]]), torch.tensor([[0.25]]), torch.tensor([[True]]),
                                          0.5, 0.5, whiten=False)
    assert (adv.item(), ret.item()) == pytest.approx((0.75, 1.0))
    # two tokens, gamma 0.9 lam 0.5: d1 = 1 - 0.4 = 0.6, d0 = 0 + 0.9*0.4 - 0.2 = 0.16, A0 = 0.16 + 0.45*0.6
    adv, ret = gae_advantages_and_returns(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.2, 0.4]]),
                                          torch.tensor([[True, True]]), 0.9, 0.5, whiten=False)
    close(adv, [[0.43, 0.6]])
    close(ret, [[0.63, 1.0]])


def test_token_level_rewards_put_the_outcome_on_the_last_token_and_the_kl_on_every_token() -> None:
    mask = torch.tensor([[True, True, True], [True, False, False], [False, False, False]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 7.0, 7.0], [1.0, 1.0, 1.0]])
    out = token_level_rewards(torch.tensor([1.0, -1.0, 3.0]), mask, kl, kl_coef=0.5)
    close(out, [[-0.05, -0.1, 0.85], [-1.25, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert token_level_rewards(torch.tensor([2.0, 0.0, 0.0]), mask).tolist() == [[0, 0, 2.0], [0, 0, 0], [0, 0, 0]]


def test_value_loss_clipping_by_hand() -> None:
    new, old, ret = torch.tensor([[1.0, 0.0, 0.5]]), torch.tensor([[0.0, 0.0, 0.4]]), torch.tensor([[2.0, 1.0, 0.0]])
    # token 0: V moved +1, clipped to +0.2: max((1-2)^2, (0.2-2)^2) = 3.24 (clip active)
    # token 1: V = old = 0: (0-1)^2 = 1 both ways; token 2: +0.1 inside the clip: 0.25
    t = value_loss_per_token(new, old, ret, value_clip=0.2)
    close(t.loss, [[0.5 * 3.24, 0.5, 0.5 * 0.25]])
    assert t.clipped.tolist() == [[True, False, False]]
    # moving toward the return beyond the clip is not rewarded: new 1.9 -> clipped 0.2
    t = value_loss_per_token(torch.tensor([1.9]), torch.tensor([0.0]), torch.tensor([2.0]), value_clip=0.2)
    assert t.loss.item() == pytest.approx(0.5 * 1.8 ** 2) and t.clipped.item()
    plain = value_loss_per_token(new, old, ret, value_clip=None)
    close(plain.loss, [[0.5, 0.5, 0.125]])
    assert not plain.clipped.any()


def test_explained_variance_by_hand() -> None:
    ret = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[True, True, True, True]])
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(ret, 2.5), ret, mask) == pytest.approx(0.0)
    # R - V = [0, 1, 0, 1]: var 0.25 against var(R) 1.25
    assert explained_variance(torch.tensor([[1.0, 1.0, 3.0, 3.0]]), ret, mask) == pytest.approx(0.8)
    assert explained_variance(ret, torch.ones_like(ret), mask) == 0.0


def test_ppo_needs_values_for_its_advantages() -> None:
    with pytest.raises(ValueError, match="critic"):
        compute_advantages("ppo", torch.tensor([1.0, 0.0]), 2, torch.ones(2, 3, dtype=torch.bool))


# ---- the trainer's step against a plain-torch reference -------------------------------
def _sample_logprobs(model: torch.nn.Module, s) -> torch.Tensor:
    """The logprob of each response token of one sample, unpadded."""
    ids = s.prompt_ids + s.response_ids
    x = torch.tensor([ids])
    logits = model(input_ids=x, attention_mask=torch.ones_like(x), position_ids=torch.arange(len(ids))[None]).logits
    lp = torch.log_softmax(logits[0, :-1].float(), -1)
    return lp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)[len(s.prompt_ids) - 1:]


def _sample_values(critic: torch.nn.Module, s) -> torch.Tensor:
    """The critic's value before each response token of one sample, unpadded."""
    ids = s.prompt_ids + s.response_ids
    h = critic.trunk(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                     position_ids=torch.arange(len(ids))[None]).last_hidden_state
    return critic.head(h[0, :-1]).squeeze(-1)[len(s.prompt_ids) - 1:]


def reference_ppo_step(policy: torch.nn.Module, ref_model: torch.nn.Module, critic: torch.nn.Module,
                       samples: list, rewards: list[float], hp) -> dict[str, float]:
    """One PPO step in one process, one sample at a time (no padding): old logprobs and
    values, KL-in-reward token rewards, GAE (plain Python), whitening, then per epoch the
    PPO-clip token mean and the clipped value loss, an AdamW step for each model between
    epochs; leaves the last epoch's gradients on ``policy`` and ``critic``."""
    logprobs = _sample_logprobs
    values = functools.partial(_sample_values, critic)
    width = max(len(s.response_ids) for s in samples)
    with torch.no_grad():
        old_lp = [logprobs(policy, s) for s in samples]
        old_v = [values(s).tolist() for s in samples]
        kl = [kl_per_token(o, logprobs(ref_model, s), hp.kl_estimator).tolist() for o, s in zip(old_lp, samples)]
    mask = [[t < len(s.response_ids) for t in range(width)] for s in samples]
    pad = lambda row: row + [0.0] * (width - len(row))  # noqa: E731
    tok_r = [pad([-hp.kl_coef * k for k in kl[i]]) for i in range(len(samples))]
    for i, s in enumerate(samples):
        tok_r[i][len(s.response_ids) - 1] += rewards[i]
    adv, ret = gae_reference(tok_r, [pad(v) for v in old_v], mask, hp.gamma, hp.lam)
    adv = whiten_reference(adv, mask)

    n_tok = sum(len(s.response_ids) for s in samples)
    popt = torch.optim.AdamW(list(policy.parameters()), lr=hp.lr, betas=hp.betas, eps=hp.eps,
                             weight_decay=hp.weight_decay, foreach=False)
    copt = torch.optim.AdamW(list(critic.parameters()), lr=hp.critic_lr, betas=hp.betas, eps=hp.eps,
                             weight_decay=hp.weight_decay, foreach=False)
    for epoch in range(hp.ppo_epochs):
        popt.zero_grad()
        copt.zero_grad()
        pg_total, v_total, clipped = 0.0, 0.0, 0
        for i, s in enumerate(samples):
            n = len(s.response_ids)
            a = torch.tensor(adv[i][:n])
            ratio = torch.exp(logprobs(policy, s) - old_lp[i])
            pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - hp.clip_eps, 1 + hp.clip_eps)).sum() / n_tok
            pg.backward()
            v = values(s)
            old, r = torch.tensor(old_v[i]), torch.tensor(ret[i][:n])
            v_clip = old + (v - old).clamp(-hp.value_clip, hp.value_clip)
            vl = 0.5 * torch.maximum((v - r) ** 2, (v_clip - r) ** 2).sum() / n_tok
            (hp.vf_coef * vl).backward()
            clipped += int(((v_clip - r) ** 2 > (v - r) ** 2).sum())
            pg_total += float(pg.detach())
            v_total += float(vl.detach())
        if epoch < hp.ppo_epochs - 1:
            popt.step()
            copt.step()
    return {"pg_loss": pg_total, "value_loss": v_total, "value_clip_fraction": clipped / n_tok}


def test_trainer_step_matches_the_plain_torch_reference() -> None:
    """The trainer's (padded, micro-batched) step: the same loss terms and the same
    gradients (left on the parameters after the step) as the reference."""
    # two epochs, so the second sees moved values (the clip acts) and ratios off 1; Adam's
    # eps large enough that its first step is smooth in the gradient (no sign flips on
    # float noise) and the grads after it compare at a tight tolerance
    hp = hparams(estimator="ppo", kl_coef=0.1, kl_in_reward=True, ppo_epochs=2, warmup_steps=0, lr=1e-2,
                 critic_lr=5e-2, eps=0.1, gamma=0.95, lam=0.9, value_clip=0.01, vf_coef=0.5, micro_batch_size=3,
                 grad_clip=1e9)
    tr = new_trainer(kl_coef=0.1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a reference away from the policy, so the KL penalty is not zero
        for p in tr.ref_model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    tr.ensure_critic(hp)
    policy, critic = copy.deepcopy(tr.model), copy.deepcopy(tr.critic.model)
    samples, rewards = rollout(1)
    got = tr.train_step(samples, rewards, group_size=4, hparams=hp)
    want = reference_ppo_step(policy, tr.ref_model, critic, samples, rewards, hp)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
    assert got["kl"] > 0 and 0 < got["value_clip_fraction"] < 1, got  # the KL and the value clip both act
    for mine, theirs in ((tr.model, policy), (tr.critic.model, critic)):
        for (name, p), q in zip(mine.named_parameters(), theirs.parameters()):
            assert p.grad is not None and q.grad is not None, name
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-7, msg=name)


# ---- the critic's life cycle ----------------------------------------------------------
def _critic_tensors(tr: PolicyTrainer) -> dict[str, torch.Tensor]:
    assert tr.critic is not None
    opt = tr.critic.optimizer.state_dict()["state"]
    return {**tr.critic.state_dict(), **{f"opt.{i}.{k}": t for i in opt for k, t in opt[i].items()}}


def test_critic_starts_from_the_policy_and_trains_separately() -> None:
    tr = new_trainer(kl_coef=0.0)
    before = tr.published_state()
    m = tr.train_step(*rollout(0), group_size=4, hparams=hparams(estimator="ppo", kl_coef=0.0))
    assert tr.critic is not None and tr.critic.steps == 1
    for k in ("value_loss", "value_clip_fraction", "explained_variance", "critic_grad_norm"):
        assert math.isfinite(m[k]) and k in m
    assert m["critic_grad_norm"] > 0 and m["grad_norm"] > 0
    assert not any(k.startswith(("trunk.", "head.")) for k in tr.published_state())  # engines get the policy only
    fresh = new_trainer(kl_coef=0.0)
    fresh.ensure_critic(hparams(estimator="ppo", kl_coef=0.0))
    trunk = {k.removeprefix("trunk."): v for k, v in fresh.critic.state_dict().items() if k.startswith("trunk.")}
    assert all(torch.equal(v, before[f"model.{k}"]) for k, v in trunk.items())  # the trunk is the policy's
    assert any(not torch.equal(v, fresh.critic.state_dict()[k]) for k, v in tr.critic.state_dict().items())


def test_critic_warmup_trains_the_critic_only() -> None:
    tr = new_trainer(kl_coef=0.0)
    hp = hparams(estimator="ppo", kl_coef=0.0, critic_warmup_steps=1)
    before = tr.checksum()
    m = tr.train_step(*rollout(0), group_size=4, hparams=hp)
    assert tr.checksum() == before and tr.policy_version == 1 and m["grad_norm"] == 0 and m["critic_grad_norm"] > 0
    tr.train_step(*rollout(1), group_size=4, hparams=hp)
    assert tr.checksum() != before and tr.critic.steps == 2


def test_critic_checkpoint_continues_bitwise_and_replay_recreates_it(tmp_path: Path) -> None:
    hp = hparams(estimator="ppo", kl_coef=0.1, kl_in_reward=True)
    a = new_trainer(kl_coef=0.1)
    a.save_state(tmp_path / "v0")  # before the first ppo step: no critic yet
    assert not (tmp_path / "v0" / CRITIC_WEIGHTS).exists()
    a.train_step(*rollout(0), group_size=4, hparams=hp)
    a.save_state(tmp_path / "v1")
    assert (tmp_path / "v1" / CRITIC_WEIGHTS).exists() and (tmp_path / "v1" / CRITIC_OPTIM).exists()
    b = PolicyTrainer.from_state(tmp_path / "v1")  # restored critic
    c = PolicyTrainer.from_state(tmp_path / "v0")  # replays step 1, creating the critic again
    assert c.critic is None
    c.train_step(*rollout(0), group_size=4, hparams=hp)
    for t in (a, b, c):
        t.train_step(*rollout(1), group_size=4, hparams=hp)
    ref = _critic_tensors(a)
    for other in (b, c):
        got = _critic_tensors(other)
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
        assert other.checksum() == a.checksum() and other.critic.steps == 2


def test_corrupt_critic_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tr = new_trainer(kl_coef=0.0)
    tr.train_step(*rollout(0), group_size=4, hparams=hparams(estimator="ppo", kl_coef=0.0))
    tr.save_state(tmp_path)
    sd = load_file(str(tmp_path / CRITIC_WEIGHTS))
    sd["head.bias"] = sd["head.bias"] + 1
    save_file(sd, str(tmp_path / CRITIC_WEIGHTS))
    with pytest.raises(ValueError, match="critic checksum"):
        PolicyTrainer.from_state(tmp_path)


def test_micro_batch_split_changes_neither_the_value_loss_nor_the_critic_gradient() -> None:
    results = []
    for mbs in (1, 8):
        tr = new_trainer(kl_coef=0.0)
        hp = hparams(estimator="ppo", kl_coef=0.0, micro_batch_size=mbs, ppo_epochs=1, grad_clip=1e9)
        m = tr.train_step(*rollout(0), group_size=4, hparams=hp)
        results.append((m, {n: p.grad.clone() for n, p in tr.critic.model.named_parameters() if p.grad is not None}))
    (m1, g1), (m8, g8) = results
    for k in ("value_loss", "value_clip_fraction", "explained_variance", "pg_loss"):
        assert m1[k] == pytest.approx(m8[k], rel=1e-4, abs=1e-7), k
    assert g1.keys() == g8.keys() and g1
    for name in g1:
        assert torch.allclose(g1[name], g8[name], rtol=1e-3, atol=1e-7), name
