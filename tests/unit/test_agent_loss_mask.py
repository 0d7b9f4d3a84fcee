"""The loss-mask rule against a plain reference: one GRPO step of the trainer on agent
episodes (tool-turn tokens masked) equals a one-process reference written here that
computes the same update over the model's own tokens only."""

from __future__ import annotations

import copy
import tempfile
from functools import cache
from pathlib import Path

import torch

from gpu_runtime.data.tool_arithmetic import generate_tool_arithmetic
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.store.artifacts import EpisodeInfo, Sample
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from gpu_runtime.trainer.base_model import base_model_folder
from spec.model import ModelInitSpec, ModelSpec
from spec.train import TrainSpec

ROWS = generate_tool_arithmetic(16, 0, 99, "*", min_operand=10)
INIT = ModelInitSpec(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128)


@cache
def base() -> Path:
    source = ModelSpec(init=INIT)
    return base_model_folder(source, ROWS, 3, Path(tempfile.mkdtemp(prefix="agent-mask-")))


def episodes() -> tuple[list[Sample], list[float]]:
    """2 groups of 3 episodes: model turn, tool turn (masked), model turn."""
    tok = Tokenizer.load(base())
    samples, rewards = [], []
    for p in range(2):
        prompt = tok.encode_chat(ROWS[p]["messages"])
        for g in range(3):
            turn0 = tok.encode(f"<calculator>{p + 2}*{g + 3}</calculator>")
            tool = tok.encode(f"\ntool\n{(p + 2) * (g + 3)}\n")
            turn1 = tok.encode(str(p * 10 + g)) + [tok.eos_token_id]
            ids = turn0 + tool + turn1
            mask = [1] * len(turn0) + [0] * len(tool) + [1] * len(turn1)
            samples.append(Sample(
                sample_id=f"s-p{p}-g{g}", prompt_index=p, group_index=g, prompt_ids=prompt, response_ids=ids,
                logprobs=[-1.0 if m else 0.0 for m in mask], weight_version=0, finish_reason="stop",
                loss_mask=mask, episode=EpisodeInfo(outcome="completed", turns=2, tool_calls=1, tool_errors=0)))
            rewards.append(float(g == p))
    return samples, rewards


def reference_step(model: torch.nn.Module, samples: list[Sample], rewards: list[float], lr: float) -> None:
    """GRPO (population std per group) with ratio 1 (one epoch), token mean over the model's tokens only, grad clip 1, AdamW."""
    r = torch.tensor(rewards).view(-1, 3)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-6)).view(-1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=False)
    opt.zero_grad()
    total, n = torch.zeros(()), 0
    for i, s in enumerate(samples):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = model(input_ids=ids).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        for j, m in enumerate(s.loss_mask or []):
            if m:
                t = len(s.prompt_ids) - 1 + j
                total = total - adv[i] * torch.exp(lp[t] - lp[t].detach())
                n += 1
    (total / n).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


HP = TrainSpec(lr=1e-3, kl_coef=0.0, ppo_epochs=1, micro_batch_size=64, grad_clip=1.0)


def stepped(masked: bool) -> tuple[torch.nn.Module, torch.nn.Module, dict[str, float], list[Sample]]:
    """From the same weights, one trainer step on ``episodes()`` (with their loss masks, or
    without: every token trained) and one reference step (masked): the trainer's model, the
    reference model, the trainer's metrics and the samples."""
    torch.set_num_threads(1)
    tr = PolicyTrainer.create(base(), HP, 3)
    ref = copy.deepcopy(tr.model)
    samples, rewards = episodes()
    trained = samples if masked else [s.model_copy(update={"loss_mask": None}) for s in samples]
    m = tr.train_step(trained, rewards, group_size=3, hparams=HP)
    reference_step(ref, samples, rewards, HP.lr)
    return tr.model, ref, m, samples


def test_a_trainer_step_on_episodes_matches_the_plain_reference() -> None:
    model, ref, m, samples = stepped(masked=True)
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    # AdamW's first step moves a weight by about lr (1e-3) whatever its gradient's size: training on
    # the tool tokens too moves some weights by 2e-3 more; float order differences stay below 1e-5
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=0, atol=1e-5, msg=name)
    assert m["tokens"] == sum(sum(s.loss_mask or []) for s in samples) < sum(len(s.response_ids) for s in samples)


def test_training_on_the_tool_tokens_would_differ() -> None:
    """The comparison above can fail: the same step without the mask is far from the reference."""
    model, ref, _, _ = stepped(masked=False)
    got = dict(model.named_parameters())
    assert max(float((got[k] - p).detach().abs().max()) for k, p in ref.named_parameters()) > 1e-3
