"""On-policy distillation: a teacher scores the student's own samples, token by token.

The teacher is a frozen Hugging Face folder (``distill.teacher_path``) with the student's
tokenizer, loaded once by the trainer process and never checkpointed (the path is the
state). Per response token *t* of a sample the student drew,

    A_t += coef * (logp_teacher(y_t) - logp_old(y_t))

where ``logp_old`` is the student's log-probability at the start of the step (no grad):
the negative per-token reverse KL, added to the estimator's advantage and trained by
the run's policy loss (Thinking Machines' / Tinker's on-policy distillation, Miles' OPD).
A token the teacher finds likelier than the student is pushed up, and vice versa. The
step reports ``distill_kl``: the token mean of ``logp_old - logp_teacher``, an unbiased
(k1) estimate of KL(student || teacher) on the student's samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

from gpu_runtime.algorithms.logprobs import logprobs_and_logits
from gpu_runtime.models.causal_lm import load_causal_lm
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.trainer.common.batches import MicroBatch
from spec.model import DistillSpec


@dataclass(frozen=True)
class Teacher:
    """The frozen teacher and ``distill.coef``, as a train step uses them."""

    model: PreTrainedModel
    coef: float


def load_teacher(settings: DistillSpec, student_tokenizer: Tokenizer) -> PreTrainedModel:
    """The frozen teacher; a ValueError naming ``distill.teacher_path`` when the folder is not
    a model or its tokenizer is not the student's (its logprobs would score other tokens)."""
    folder = Path(settings.teacher_path).expanduser()
    try:
        teacher_tok = Tokenizer.load(folder)
        teacher = load_causal_lm(folder)
    except (FileNotFoundError, OSError) as err:
        raise ValueError(f"distill.teacher_path: {folder} is not a readable model folder: {err}") from None
    if teacher_tok.hf.get_vocab() != student_tokenizer.hf.get_vocab():
        raise ValueError(f"distill.teacher_path: {folder} has another tokenizer than the student (the vocabularies differ)")
    if teacher.config.vocab_size < student_tokenizer.vocab_size:
        raise ValueError(f"distill.teacher_path: {folder}: vocab_size {teacher.config.vocab_size} < the tokenizer's")
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def distill_terms(
    teacher: PreTrainedModel, batches: list[MicroBatch], old_lps: list[torch.Tensor], coef: float,
    precision: str = "fp32",
) -> tuple[list[torch.Tensor], float]:
    """Per micro-batch (``[B, T-1]`` layout) the advantage term ``coef * (teacher - old)`` on
    response tokens (0 elsewhere), and the step's token-mean reverse KL. The teacher's forward
    runs in the step's ``train.precision``, like the policy's."""
    terms, kl_sum, n = [], 0.0, 0
    with torch.no_grad():
        for b, old in zip(batches, old_lps):
            teacher_lp = logprobs_and_logits(teacher, b.ids, b.mask, precision)[0]
            gap = (teacher_lp - old) * b.tmask
            terms.append(coef * gap)
            kl_sum -= float(gap.sum())
            n += int(b.tmask.sum())
    return terms, kl_sum / max(n, 1)
