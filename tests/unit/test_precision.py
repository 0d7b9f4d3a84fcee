"""``train.precision: bf16``: bf16 autocast forwards over float32 master weights.

The reference is a hand-written loop in this file (the same recipe, one process): a
transformers model, ``torch.autocast`` around its forward only, the GRPO / SFT loss written
out in float32, AdamW with float32 states. ``PolicyTrainer`` with ``precision: bf16`` must
end on the same weights **bitwise**: both sides run the same kernels on the same inputs in
the same order (the padded positions differ, but they never reach a real token's logits,
and the float32 loss sums have the same shape), so any difference is a real one: a forward
outside autocast, a bf16 log-softmax, bf16 master weights or AdamW states.
Against float32: the same steps give different (not equal) numbers, within what bf16's
8-bit mantissa explains.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from gpu_runtime.data.datasets import encode_prompt, sft_target
from gpu_runtime.models.causal_lm import ATTENTION, export_state_dict
from gpu_runtime.models.precision import autocast_dtype, forward_precision
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from spec.train import TrainSpec
from tests.unit.test_policy_trainer import ROWS, TOK, base, hparams, optimizer_tensors, rollout

SEED = 7
STEPS = 3
GROUP = 4
# one micro-batch per step, one epoch, no KL, constant LR: the recipe the plain loop writes out
RECIPE = dict(micro_batch_size=64, ppo_epochs=1, kl_coef=0.0, warmup_steps=0, lr=1e-3)


def plain_model(folder: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation=ATTENTION,
                                                 local_files_only=True)
    model.train()
    return model


def plain_logprobs(model: torch.nn.Module, seqs: list[list[int]], prompt_lens: list[int],
                   bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token logprobs [B, T-1] of right-padded ``seqs`` (the forward under bf16 autocast
    when ``bf16``, everything after it float32) and the mask of response targets."""
    width = max(len(s) for s in seqs)
    ids = torch.tensor([s + [TOK.pad_token_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    positions = torch.arange(width)[None, :].expand(len(seqs), width)
    region = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with region:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logits = logits.float()[:, :-1]
    lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    target = torch.arange(1, width)[None, :]
    lens = torch.tensor([len(s) for s in seqs])[:, None]
    tmask = ((target >= torch.tensor(prompt_lens)[:, None]) & (target < lens)).float()
    return lp, tmask


def plain_step(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> float:
    """Backward, clip the grad norm to 1 (``train.grad_clip``), AdamW; the norm before clipping."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0))
    opt.step()
    return norm


def plain_grpo(bf16: bool) -> tuple[list[float], dict[str, torch.Tensor], torch.optim.Optimizer]:
    """STEPS GRPO updates: group-normalised advantages, PPO-clip (ratio 1: one epoch), token mean."""
    model = plain_model(base(SEED))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=False)
    norms = []
    for s in range(1, STEPS + 1):
        samples, rewards = rollout(s, group=GROUP)
        lp, tmask = plain_logprobs(model, [x.prompt_ids + x.response_ids for x in samples],
                                   [len(x.prompt_ids) for x in samples], bf16)
        r = torch.tensor(rewards).view(-1, GROUP)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-6)).reshape(-1, 1)
        ratio = torch.exp(lp - lp.detach())
        per_token = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.2))
        norms.append(plain_step(model, opt, (per_token * tmask).sum() / tmask.sum()))
    return norms, export_state_dict(model), opt


def sft_rows(step: int) -> list[dict]:
    return ROWS[8 * (step - 1): 8 * step]


def plain_sft(bf16: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS supervised updates: NLL of target + EOS, token mean."""
    model = plain_model(base(SEED))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=False)
    losses = []
    for s in range(1, STEPS + 1):
        pairs = [(encode_prompt(TOK, r), TOK.encode(sft_target(r)) + [TOK.eos_token_id]) for r in sft_rows(s)]
        lp, tmask = plain_logprobs(model, [p + c for p, c in pairs], [len(p) for p, _ in pairs], bf16)
        loss = -(lp * tmask).sum() / tmask.sum()
        losses.append(float(loss.detach()))
        plain_step(model, opt, loss)
    return losses, export_state_dict(model)


def milestone_grpo(precision: str) -> tuple[list[dict[str, float]], PolicyTrainer]:
    hp = hparams(precision=precision, **RECIPE)
    tr = PolicyTrainer.create(base(SEED), hp, SEED)
    return [tr.train_step(*rollout(s, group=GROUP), GROUP, hp) for s in range(1, STEPS + 1)], tr


def milestone_sft(precision: str) -> tuple[list[dict[str, float]], PolicyTrainer]:
    hp = hparams(precision=precision, **RECIPE)
    tr = PolicyTrainer.create(base(SEED), hp, SEED)
    return [tr.sft_step(sft_rows(s), hp) for s in range(1, STEPS + 1)], tr


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"not bitwise: {differ[:5]} (max |diff| {max(float((a[k] - b[k]).abs().max()) for k in differ)})"


@pytest.fixture(scope="module")
def grpo_runs() -> dict[str, tuple[list[dict[str, float]], PolicyTrainer]]:
    torch.set_num_threads(1)
    return {p: milestone_grpo(p) for p in ("fp32", "bf16")}


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_grpo_steps_equal_the_plain_loop_bitwise(grpo_runs, precision: str) -> None:
    norms, weights, opt = plain_grpo(bf16=precision == "bf16")
    metrics, tr = grpo_runs[precision]
    assert [m["grad_norm"] for m in metrics] == norms
    assert_bitwise(tr.published_state(), weights)
    assert len(optimizer_tensors(tr)) == sum(len(v) for v in opt.state_dict()["state"].values())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_sft_steps_equal_the_plain_loop_bitwise(precision: str) -> None:
    losses, weights = plain_sft(bf16=precision == "bf16")
    metrics, tr = milestone_sft(precision)
    assert [m["loss"] for m in metrics] == losses
    assert_bitwise(tr.published_state(), weights)


def test_bf16_changes_the_numbers_by_what_bf16_explains(grpo_runs) -> None:
    """bf16 is not float32 in disguise: every grad norm, SFT loss and the weights differ, but
    by bf16 rounding, not by a different computation. Measured here (3 steps, tiny model):
    grad norms within 8e-4 relative, SFT losses 3e-5, entropies 2e-6, and the total update
    w - w0 within 6% (cosine 0.998) of float32's; the bounds below leave 2.5-5x room.
    (Compared elementwise the weights are not close: AdamW moves a weight by ~lr whatever
    the size of its gradient, so bf16 noise that flips a near-zero gradient flips its update.)"""
    (m32, t32), (m16, t16) = grpo_runs["fp32"], grpo_runs["bf16"]
    for a, b in zip(m32, m16):
        assert a["grad_norm"] != b["grad_norm"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-3)
        assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-4)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)  # ratio 1: -mean advantage, the same batch
    initial = export_state_dict(plain_model(base(SEED)))
    w32, w16 = t32.published_state(), t16.published_state()
    u32 = torch.cat([(w32[k] - initial[k]).flatten() for k in initial])
    u16 = torch.cat([(w16[k] - initial[k]).flatten() for k in initial])
    rel = float((u16 - u32).norm() / u32.norm())
    assert 0 < rel < 0.15, f"|bf16 update - fp32 update| / |fp32 update| = {rel}"
    sft32, _ = milestone_sft("fp32")
    sft16, _ = milestone_sft("bf16")
    for a, b in zip(sft32, sft16):
        assert a["loss"] != b["loss"] and b["loss"] == pytest.approx(a["loss"], rel=1e-4)


def test_bf16_keeps_float32_master_weights_and_adamw_states(grpo_runs) -> None:
    _, tr = grpo_runs["bf16"]
    assert {p.dtype for p in tr.model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in tr.model.parameters() if p.grad is not None} == {torch.float32}
    assert {t.dtype for t in optimizer_tensors(tr) if t.dim() > 0} == {torch.float32}


def test_bf16_replay_after_a_restore_is_bitwise(tmp_path: Path) -> None:
    """A killed trainer's successor loads the last checkpoint and replays the stored steps:
    with bf16 it ends on the same weights, AdamW state and metrics as the run that never stopped."""
    torch.set_num_threads(1)
    hp = hparams(precision="bf16", micro_batch_size=3, ppo_epochs=2, kl_coef=0.1)  # several micro-batches, KL, 2 epochs
    tr = PolicyTrainer.create(base(SEED), hp, SEED)
    tr.sft_warmup(ROWS, steps=2, batch_size=8, lr=1e-3, seed=SEED, betas=(0.9, 0.95))
    for s in (1, 2):
        tr.train_step(*rollout(s), 4, hp)
    tr.save_state(tmp_path / "ckpt")
    tail = [tr.train_step(*rollout(s), 4, hp) for s in (3, 4)]
    restored = PolicyTrainer.from_state(tmp_path / "ckpt")
    assert restored.hparams.precision == "bf16"
    replayed = [restored.train_step(*rollout(s), 4, restored.hparams) for s in (3, 4)]
    assert [m["grad_norm"] for m in replayed] == [m["grad_norm"] for m in tail]
    assert restored.checksum() == tr.checksum()
    assert all(torch.equal(a, b) for a, b in zip(optimizer_tensors(restored), optimizer_tensors(tr)))


def test_precision_is_validated_and_old_records_read_as_fp32() -> None:
    assert TrainSpec().precision == "fp32"
    with pytest.raises(ValidationError, match="precision"):
        TrainSpec(precision="fp16")
    with pytest.raises(ValueError, match="train.precision"):
        autocast_dtype("fp16")
    raw = hparams().model_dump(mode="json")
    del raw["precision"]
    assert TrainSpec.model_validate(raw).precision == "fp32"  # a step stored before the knob replays as float32


def test_fp32_runs_no_autocast_and_bf16_only_around_the_forward() -> None:
    x = torch.ones(2, 2)
    with forward_precision("fp32", "cpu"):
        assert not torch.is_autocast_enabled("cpu") and (x @ x).dtype == torch.float32
    with forward_precision("bf16", "cpu"):
        assert (x @ x).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
