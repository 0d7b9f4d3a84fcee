"""On-policy distillation in the trainer: the teacher's check, the per-token advantage
``coef * (teacher - old)`` against hand-computed logprobs, the reverse KL falling over a
few sample-then-train steps on a tiny model, and a bitwise restore."""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from gpu_runtime.algorithms.logprobs import logprobs_and_logits
from gpu_runtime.data.datasets import encode_prompt
from gpu_runtime.engine.generate import generate_batch
from gpu_runtime.models.model_folder import save_model_folder
from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.policy.trainer import PolicyTrainer
from gpu_runtime.trainer.common.batches import micro_batches, pad_batch
from gpu_runtime.trainer.policy.distill import distill_terms
from spec.model import DistillSpec
from spec.run import RunConfig
from tests.engine_fixtures import tiny_model
from tests.unit.test_policy_trainer import ROWS, TOK, assert_same_state, base, hparams

HP = dict(kl_coef=0.0, ppo_epochs=1, warmup_steps=0, lr=3e-3)


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


@cache
def teacher_folder() -> Path:
    """The student's base after a longer warm-up: it answers the arithmetic far better."""
    tr = PolicyTrainer.create(base(7), hparams(**HP), 7)
    tr.sft_warmup(ROWS, steps=60, batch_size=16, lr=3e-3, seed=1, betas=(0.9, 0.999))
    folder = Path(tempfile.mkdtemp(prefix="teacher-")) / "t"
    tr.export_model_folder(folder)
    return folder


def student(coef: float = 1.0, warmup: int = 3) -> PolicyTrainer:
    tr = PolicyTrainer.create(base(7), hparams(**HP), 7, distill=DistillSpec(teacher_path=str(teacher_folder()), coef=coef))
    tr.sft_warmup(ROWS, steps=warmup, batch_size=16, lr=3e-3, seed=7, betas=(0.9, 0.999))
    return tr


def on_policy(tr: PolicyTrainer, step: int, n_prompts: int = 8, group: int = 4) -> list[Sample]:
    """The student's own samples (temperature 1, seeded by ``step``): ``group`` for each of the
    first ``n_prompts`` rows."""
    rows = ROWS[:n_prompts]
    prompts = [encode_prompt(TOK, r) for r in rows for _ in range(group)]
    tr.model.eval()
    outs = generate_batch(tr.model, prompts, max_new_tokens=4, temperature=1.0, seed=1000 + step,
                          eos_id=TOK.eos_token_id, pad_id=TOK.pad_token_id)
    tr.model.train()
    return [Sample(sample_id=f"s{step}-{i}", prompt_index=i // group, group_index=i % group, prompt_ids=p,
                   response_ids=o.output_ids, logprobs=o.logprobs, weight_version=tr.policy_version,
                   finish_reason="stop") for i, (p, o) in enumerate(zip(prompts, outs))]


def test_teacher_must_be_a_model_with_the_students_tokenizer(tmp_path: Path) -> None:
    model, other_tok = tiny_model(1)  # another BPE vocabulary
    save_model_folder(model, other_tok, tmp_path / "other", weight_version=0)
    for folder, needle in ((tmp_path / "other", "another tokenizer"), (tmp_path, "not a readable model folder")):
        with pytest.raises(ValueError, match=f"distill.teacher_path: .*{needle}"):
            PolicyTrainer.create(base(7), hparams(**HP), 7, distill=DistillSpec(teacher_path=str(folder), coef=1.0))


def test_advantage_term_is_coef_times_teacher_minus_old_on_response_tokens() -> None:
    tr = student(coef=0.5)
    samples = on_policy(tr, 0, n_prompts=2)
    batches = micro_batches(samples, 3, TOK.pad_token_id)
    with torch.no_grad():
        old = [logprobs_and_logits(tr.model, b.ids, b.mask)[0] for b in batches]
        teacher = [logprobs_and_logits(tr.teacher, b.ids, b.mask)[0] for b in batches]
    terms, kl = distill_terms(tr.teacher, batches, old, 0.5)
    tokens = sum(int(b.tmask.sum()) for b in batches)
    hand_kl = sum(float(((o - t) * b.tmask).sum()) for o, t, b in zip(old, teacher, batches)) / tokens
    assert kl == pytest.approx(hand_kl, rel=1e-6) and kl > 0
    for term, o, t, b in zip(terms, old, teacher, batches):
        assert torch.equal(term[~b.tmask], torch.zeros(int((~b.tmask).sum())))
        torch.testing.assert_close(term[b.tmask], 0.5 * (t - o)[b.tmask], rtol=0, atol=0)
    # a teacher equal to the student adds nothing
    same, zero = distill_terms(tr.model, batches, old, 0.5)
    assert zero == 0.0 and all(torch.equal(s, torch.zeros_like(s)) for s in same)


def first_token_reverse_kl(tr: PolicyTrainer, rows: list[dict]) -> float:
    """KL(student || teacher) of the first response token's distribution, exact (the whole
    vocabulary), averaged over ``rows``' prompts: the step metric's sampled estimate is noisy."""
    prompts = [encode_prompt(TOK, r) for r in rows]
    ids, mask = pad_batch(prompts, TOK.pad_token_id)
    at = (torch.arange(len(prompts)), torch.tensor([len(p) - 1 for p in prompts]))
    assert tr.teacher is not None
    with torch.no_grad():
        s, t = (torch.log_softmax(m(input_ids=ids, attention_mask=mask.long()).logits.float(), -1)[at]
                for m in (tr.model, tr.teacher))
    return float((s.exp() * (s - t)).sum(-1).mean())


def test_reverse_kl_falls_over_a_few_on_policy_steps() -> None:
    """Distillation alone (every task reward 0, so GRPO's advantage is 0): the student's
    reverse KL to the teacher falls on every step."""
    tr = student(warmup=20)  # close enough to the teacher that its samples land where the teacher has mass
    kls, reported = [first_token_reverse_kl(tr, ROWS[:8])], []
    for step in range(8):
        samples = on_policy(tr, step)
        m = tr.train_step(samples, [0.0] * len(samples), group_size=4, hparams=tr.hparams)
        reported.append(m["distill_kl"])
        kls.append(first_token_reverse_kl(tr, ROWS[:8]))
    assert all(b < a for a, b in zip(kls, kls[1:])) and kls[-1] < 0.8 * kls[0], kls
    assert all(0 < k < 10 for k in reported), reported


def test_restore_with_a_teacher_continues_bitwise(tmp_path: Path) -> None:
    a = student()
    a.train_step(on_policy(a, 0), [0.0] * 32, group_size=4, hparams=a.hparams)
    a.save_state(tmp_path / "s")
    batch = on_policy(a, 1)
    a.train_step(batch, [1.0, 0.0] * 16, group_size=4, hparams=a.hparams)
    b = PolicyTrainer.create(base(7), hparams(**HP), 7, distill=a.distill)  # the teacher is reloaded from its path
    b.load_state(tmp_path / "s")
    b.train_step(batch, [1.0, 0.0] * 16, group_size=4, hparams=b.hparams)
    assert_same_state(a, b)


def test_distill_config() -> None:
    cfg = RunConfig.model_validate({"distill": {"teacher_path": "/models/teacher"}})
    assert cfg.distill is not None and cfg.distill.coef == 1.0 and RunConfig().distill is None
    for raw, needle in [({"distill": {"teacher_path": ""}}, "teacher_path"), ({"distill": {}}, "teacher_path"),
                        ({"distill": {"teacher_path": "/t", "coef": 0}}, "coef"),
                        ({"mode": "sft", "sft": {"steps": 0}, "distill": {"teacher_path": "/t"}}, "applies to mode rl")]:
        with pytest.raises(ValidationError, match=needle):
            RunConfig.model_validate(raw)


def test_cli_resolves_a_relative_teacher_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from milestone_cli.config_file import load_run_config

    (tmp_path / "run.yaml").write_text("distill: {teacher_path: models/teacher, coef: 0.5}\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_run_config(tmp_path / "run.yaml")
    assert cfg.distill is not None and cfg.distill.teacher_path == str(tmp_path / "models" / "teacher")
