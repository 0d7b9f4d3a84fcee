"""The trainer trains the policy that sampled (``rollout.temperature``): the trainer's step at
T = 0.7 against a one-process plain-torch reference that divides the logits by T, the torch
engine's reported logprobs against a transformers forward of logits / T, and the
train-inference gap, which is ~0 only when both sides divide by the same T."""

from __future__ import annotations

import copy

import pytest
import torch

from gpu_runtime.algorithms.logprobs import tempered
from gpu_runtime.data.datasets import encode_prompt
from gpu_runtime.engine.generate import generate_batch
from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.common.batches import cell_reduced
from tests.unit.test_policy_trainer import ROWS, TOK, hparams, new_trainer, rollout

T = 0.7


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


# ---- the trainer's step against a plain reference --------------------------------------
def _forward_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """A plain transformers forward of one unpadded sequence: the next-token logits [len-1, V]."""
    x = torch.tensor([ids])
    out = model(input_ids=x, attention_mask=torch.ones_like(x), position_ids=torch.arange(len(ids))[None])
    return out.logits[0, :-1].float()


def _response_terms(model: torch.nn.Module, s: Sample, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob, entropy) of each response token of one sample under softmax(logits / T)."""
    ids = s.prompt_ids + s.response_ids
    logp = torch.log_softmax(_forward_logits(model, ids) / temperature, -1)[len(s.prompt_ids) - 1:]
    lp = logp.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def reference_grpo_step(policy: torch.nn.Module, ref_model: torch.nn.Module, samples: list[Sample],
                        rewards: list[float], hp, temperature: float) -> dict[str, float]:
    """GRPO in one process, one sample at a time, every distribution softmax(logits / T): group
    advantages (population std), per epoch the PPO-clip token mean + kl_coef * the k3 KL to the
    reference - entropy_coef * the entropy, an AdamW step between epochs; the last epoch's
    gradients stay on ``policy``."""
    r = torch.tensor(rewards).view(-1, 4)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-6)).reshape(-1)
    with torch.no_grad():
        old = [_response_terms(policy, s, temperature)[0] for s in samples]
        ref = [_response_terms(ref_model, s, temperature)[0] for s in samples]
    n_tok = sum(len(s.response_ids) for s in samples)
    opt = torch.optim.AdamW(list(policy.parameters()), lr=hp.lr, betas=hp.betas, eps=hp.eps,
                            weight_decay=hp.weight_decay, foreach=False)
    for epoch in range(hp.ppo_epochs):
        opt.zero_grad()
        totals = {"pg_loss": 0.0, "kl": 0.0, "entropy": 0.0}
        for i, s in enumerate(samples):
            lp, ent = _response_terms(policy, s, temperature)
            ratio = torch.exp(lp - old[i])
            pg = torch.maximum(-adv[i] * ratio, -adv[i] * ratio.clamp(1 - hp.clip_eps, 1 + hp.clip_eps)).sum() / n_tok
            d = ref[i] - lp
            kl = (torch.exp(d) - d - 1).sum() / n_tok
            ent_mean = ent.sum() / n_tok
            (pg + hp.kl_coef * kl - hp.entropy_coef * ent_mean).backward()
            for k, v in (("pg_loss", pg), ("kl", kl), ("entropy", ent_mean)):
                totals[k] += float(v.detach())
        if epoch < hp.ppo_epochs - 1:
            opt.step()
    return totals


def test_trainer_step_at_temperature_matches_the_plain_reference() -> None:
    """Loss terms and gradients of a two-epoch step (ratio off 1, KL and entropy in the loss) at
    T = 0.7 equal the reference's; the reference at T = 1 does not (the test sees T)."""
    hp = hparams(kl_coef=0.1, entropy_coef=0.05, ppo_epochs=2, warmup_steps=0, lr=1e-2, eps=0.1,
                 micro_batch_size=3, grad_clip=1e9)
    tr = new_trainer(kl_coef=0.1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a reference away from the policy, so the KL is not zero
        for p in tr.ref_model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    policy, at_one = copy.deepcopy(tr.model), copy.deepcopy(tr.model)
    samples, rewards = rollout(1)
    got = tr.train_step(samples, rewards, group_size=4, hparams=hp, temperature=T)
    want = reference_grpo_step(policy, tr.ref_model, samples, rewards, hp, T)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
    assert got["kl"] > 0 and got["clip_fraction"] > 0, got  # the KL and the clip both act
    for (name, p), q in zip(tr.model.named_parameters(), policy.parameters()):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-7, msg=name)
    reference_grpo_step(at_one, tr.ref_model, samples, rewards, hp, 1.0)  # the reference without T
    grads = [(p.grad, q.grad) for p, q in zip(tr.model.parameters(), at_one.parameters())]
    assert max(float((a - b).norm() / b.norm()) for a, b in grads) > 0.05  # T changes the gradient


def test_updated_weights_match_the_reference_optimizer_step() -> None:
    """One epoch, one AdamW step: the trainer's updated weights are the reference's at T."""
    hp = hparams(kl_coef=0.0, ppo_epochs=1, warmup_steps=0, lr=1e-2, eps=0.1, micro_batch_size=4, grad_clip=1e9)
    tr = new_trainer(kl_coef=0.0)
    policy = copy.deepcopy(tr.model)
    samples, rewards = rollout(2)
    tr.train_step(samples, rewards, group_size=4, hparams=hp, temperature=T)
    reference_grpo_step(policy, policy, samples, rewards, hp, T)  # the reference's grads, ...
    torch.optim.AdamW(list(policy.parameters()), lr=hp.lr, betas=hp.betas, eps=hp.eps,
                      weight_decay=hp.weight_decay, foreach=False).step()  # ... and its one step
    for (name, p), q in zip(tr.model.named_parameters(), policy.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-6, msg=name)


def test_temperature_one_divides_nothing() -> None:
    """T = 1 is the trainer of before, bitwise: the logits are returned as they are."""
    x = torch.randn(3, 5)
    assert tempered(x, 1.0) is x
    assert torch.equal(tempered(x, 0.5), x / 0.5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        tempered(x, 0.0)


# ---- engine and trainer: the same distribution -----------------------------------------
def engine_samples(model: torch.nn.Module, temperature: float) -> tuple[list[Sample], list[float]]:
    """Two groups of four sampled by the torch engine at ``temperature``, with its logprobs."""
    prompts = [encode_prompt(TOK, row) for row in ROWS[:2]]
    outs = generate_batch(model, [p for p in prompts for _ in range(4)], max_new_tokens=6, temperature=temperature,
                          seed=11, eos_id=TOK.eos_token_id, pad_id=TOK.pad_token_id)
    samples = [Sample(sample_id=f"s{i}", prompt_index=i // 4, group_index=i % 4, prompt_ids=prompts[i // 4],
                      response_ids=o.output_ids, logprobs=o.logprobs, weight_version=0, finish_reason=o.finish_reason)
               for i, o in enumerate(outs)]
    return samples, [float(i % 2) for i in range(len(samples))]


def test_engine_logprobs_are_those_of_logits_over_t() -> None:
    """The torch engine reports log_softmax(logits / T) of each sampled token: a transformers
    forward of the whole sequence, divided by T, gives the same numbers."""
    model = new_trainer().model.eval()
    samples, _ = engine_samples(model, T)
    with torch.no_grad():
        for s in samples:
            want, _ = _response_terms(model, s, T)
            raw, _ = _response_terms(model, s, 1.0)
            got = torch.tensor(s.logprobs)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            assert (got - raw).abs().max() > 1e-3  # T is not 1 in effect


@pytest.mark.parametrize("engine_t,trainer_t,close", [(T, T, True), (T, 1.0, False), (1.0, T, False)],
                         ids=["same-T", "trainer-drops-T", "engine-drops-T"])
def test_gap_is_small_only_when_both_sides_divide_by_t(engine_t: float, trainer_t: float, close: bool) -> None:
    """The step's train-inference gap (mean and max |engine - trainer old logprob|): ~1e-7 when
    the engine and the trainer use the same T; dropping T on either side shows (this test is
    the one that fails when either side forgets the temperature)."""
    tr = new_trainer(kl_coef=0.0)
    samples, rewards = engine_samples(copy.deepcopy(tr.model).eval(), engine_t)
    m = tr.train_step(samples, rewards, group_size=4, hparams=hparams(kl_coef=0.0, ppo_epochs=1),
                      temperature=trainer_t)
    assert m["rollout_logprob_abs_diff"] <= m["rollout_logprob_abs_diff_max"]
    if close:
        assert m["rollout_logprob_abs_diff_max"] < 1e-5, m
    else:
        assert m["rollout_logprob_abs_diff_max"] > 1e-2, m


def test_cell_reduced_adds_sums_and_takes_the_largest_maximum() -> None:
    """Three ranks' sums in one SUM allreduce: sums add up, ``gap_max`` is the largest rank's."""
    ranks = [{"loss": 1.0, "gap_total": 2.0, "gap_count": 4.0, "gap_max": 0.3},
             {"loss": 0.5, "gap_total": 1.0, "gap_count": 2.0, "gap_max": 0.7},
             {"loss": 0.25, "gap_total": 0.0, "gap_count": 0.0, "gap_max": 0.0}]
    sent: list[torch.Tensor] = []

    def fake_allreduce(t: torch.Tensor) -> None:  # every rank's tensor, summed, on every rank
        sent.append(t.clone())

    for slot, sums in enumerate(ranks):
        cell_reduced(sums, slot, len(ranks), fake_allreduce)
    total = sum(sent, torch.zeros_like(sent[0]))
    out = cell_reduced(ranks[0], 0, len(ranks), lambda t: t.copy_(total))
    assert out == {"loss": 1.75, "gap_total": 3.0, "gap_count": 6.0, "gap_max": 0.7}
