"""Score a step's samples with the run's reward: one ``SampleReward`` per sample, in order.

Every kind is a term; a plain reward is one term of weight 1, ``weighted`` sums its
terms (each term's value is kept per sample in ``SampleReward.terms``). Custom
functions, math-verify and reasoning-gym's scorers run in a killable child process (``sandbox``), the
endpoints through ``remote``, the rules in this process.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Literal

from gpu_runtime.data import reasoning_gym
from gpu_runtime.data.rewards import mathverify, remote, rules
from gpu_runtime.data.rewards.sandbox import CallFailed, CallTimeout, RewardSandbox
from gpu_runtime.data.rewards.errors import RewardFatal
from gpu_runtime.data.rows import int_answer
from gpu_runtime.store.artifacts import Sample, SampleReward
from gpu_runtime.store.object_store import ObjectStore
from spec.reward import RewardSpec, RewardTerm

log = logging.getLogger(__name__)
MATH_VERIFY_FN = mathverify.CALL
REASONING_GYM_FN = "gpu_runtime.data.rewards.reasoning_gym_call:reasoning_gym_reward"
SANDBOXED = ("custom", "math_verify", "reasoning_gym")  # kinds that run third-party code in the child


@dataclass(frozen=True)
class ScoreItem:
    index: int
    sample_id: str
    prompt: str
    response: str
    row: dict


@dataclass(frozen=True)
class TermScore:
    value: float
    correct: bool | None = None  # None: the term does not check the answer
    detail: str = ""
    error: str = ""  # the call failed and scored 0 (error_policy zero, a math-verify timeout)


@dataclass(frozen=True)
class ScoreContext:
    """Where a ``judge`` term records its results: ``<judge_prefix>/<term name>/<index>.json``."""

    store: ObjectStore | None = None
    judge_prefix: str | None = None
    backoff_s: float = remote.BACKOFF_S


@dataclass
class ScoreStats:
    errors: int = 0  # samples with a failed call scored 0
    judged: int = 0  # judge calls made now (the rest were recorded before)
    sandbox_kills: int = 0


def score_samples(
    samples: Sequence[Sample],
    rows_by_index: Mapping[int, dict] | Sequence[dict],
    spec: RewardSpec,
    ctx: ScoreContext | None = None,
    stats: ScoreStats | None = None,
) -> list[SampleReward]:
    """One SampleReward per sample, in order, scored on the sample's text (its ids decoded by
    the model's tokenizer at rollout time). ``correct`` comes from the first answer-checking
    term (math_answer, math_verify, gsm8k); without one it is the math rule when the label
    has an integer answer, else ``reward > 0``."""
    ctx = ctx or ScoreContext()
    stats = stats if stats is not None else ScoreStats()
    items = []
    failed_agents: dict[int, SampleReward] = {}  # kind openai, on_agent_error zero: not scored, rewarded 0
    for i, s in enumerate(samples):
        if s.episode is not None and s.episode.zero_reward:
            failed_agents[i] = SampleReward(
                sample_id=s.sample_id, reward=0.0, correct=False,
                detail=f"agent {s.episode.outcome}: reward 0 (rollout.agent.on_agent_error zero): {s.episode.error}")
            continue
        try:
            row = rows_by_index[s.prompt_index]
        except (KeyError, IndexError):
            raise ValueError(f"sample {s.sample_id}: prompt_index {s.prompt_index} not in dataset") from None
        items.append(ScoreItem(i, s.sample_id, s.prompt_text, s.response_text, row))
    terms = spec.term_list()
    with ExitStack() as stack:
        sandbox = stack.enter_context(RewardSandbox()) if {t.kind for t in terms} & set(SANDBOXED) else None
        per_term = [_score_term(t, items, ctx, sandbox, stats) for t in terms]
        stats.sandbox_kills += sandbox.kills if sandbox else 0
    out = []
    for k, item in enumerate(items):
        scores = [col[k] for col in per_term]
        reward = sum(t.weight * sc.value for t, sc in zip(terms, scores))
        errors = [f"{t.label}: {sc.error}" for t, sc in zip(terms, scores) if sc.error]
        stats.errors += bool(errors)
        out.append(SampleReward(
            sample_id=item.sample_id,
            reward=reward,
            correct=_correct(scores, item, reward),
            detail="; ".join(sc.detail if len(terms) == 1 else f"{t.label}: {sc.detail}"
                             for t, sc in zip(terms, scores)),
            terms={t.label: sc.value for t, sc in zip(terms, scores)} if spec.kind == "weighted" else {},
            error="; ".join(errors),
        ))
    if failed_agents:
        scored = iter(out)
        out = [failed_agents[i] if i in failed_agents else next(scored) for i in range(len(samples))]
    return out


def _correct(scores: list[TermScore], item: ScoreItem, reward: float) -> bool:
    for sc in scores:
        if sc.correct is not None:
            return sc.correct
    label = item.row.get("answer")
    if isinstance(label, str) and int_answer(label) is not None:
        return rules.math_answer_reward(item.response, item.row)[1]
    return reward > 0


def _score_term(
    term: RewardTerm, items: list[ScoreItem], ctx: ScoreContext, sandbox: RewardSandbox | None,
    stats: ScoreStats,
) -> list[TermScore]:
    kind = term.kind
    try:
        if kind == "math_answer":
            return [_math_answer(i) for i in items]
        if kind == "gsm8k":
            assert term.mode is not None and term.format_score is not None
            return [_gsm8k(i, term.mode, term.format_score) for i in items]
        if kind == "format":
            assert term.pattern is not None and term.format_score is not None
            return [_format(i, term.pattern, term.format_score) for i in items]
    except ValueError as err:  # a label the rule cannot read: the dataset, not a retry, must change
        raise RewardFatal(f"reward.kind {kind}: {err}") from err
    if kind == "reasoning_gym":
        assert sandbox is not None
        if not reasoning_gym.available():
            raise RewardFatal(reasoning_gym.MISSING)
        return [_reasoning_gym(term, i, sandbox) for i in items]
    if kind in ("custom", "math_verify"):
        assert sandbox is not None
        return [_in_sandbox(term, i, sandbox) for i in items]
    remote_items = [remote.RemoteItem(i.index, i.sample_id, i.prompt, i.response, i.row.get("answer"),
                                      i.row.get("metadata") or {}) for i in items]
    if kind == "http":
        values = remote.score_http(remote_items, term, backoff_s=ctx.backoff_s)
        return [TermScore(v, detail=f"http={v:g}") for v in values]
    if kind == "judge":
        if ctx.store is None or ctx.judge_prefix is None:
            raise RewardFatal("reward.kind judge needs a store to record its results in (ScoreContext)")
        records = remote.JudgeRecords(ctx.store, f"{ctx.judge_prefix}/{term.label}")
        try:
            values = remote.score_judge(remote_items, term, records, backoff_s=ctx.backoff_s)
        finally:  # judged now, also by a pass that failed: the next one will not ask for them
            stats.judged += records.written
        return [TermScore(v, detail=f"judge={v:g}") for v in values]
    raise RewardFatal(f"reward.kind {kind!r} has no scorer")


def _math_answer(item: ScoreItem) -> TermScore:
    reward, correct = rules.math_answer_reward(item.response, item.row)
    detail = f"answer={rules.extract_answer(item.response)!r} expected={rules.final_answer(item.row)!r}"
    return TermScore(reward, correct, detail)


def _reasoning_gym(term: RewardTerm, item: ScoreItem, sandbox: RewardSandbox) -> TermScore:
    """The generator's scorer on one sample in the killable child: a call that outlives
    ``reward.timeout_s`` scores 0 (an answer the scorer cannot judge in time is not right),
    one that raises (a row not made by the generator) fails the run."""
    answer = reasoning_gym.extract(item.response)
    try:
        value = sandbox.call(REASONING_GYM_FN, [item.prompt, item.response, item.row], term.timeout_s)
    except CallTimeout as err:
        log.warning("reasoning_gym scorer on sample %s: %s: scored 0", item.sample_id, err)
        return TermScore(0.0, False, f"reasoning_gym answer={answer!r} timed out", error=f"reasoning_gym {err}")
    except CallFailed as err:
        raise RewardFatal(f"reward.kind reasoning_gym on sample {item.sample_id}: {err}") from err
    return TermScore(value, value >= 1.0, f"reasoning_gym answer={answer!r} "
                                          f"expected={item.row.get('answer')!r} score={value:g}")


def _gsm8k(item: ScoreItem, mode: Literal["strict", "flexible"], format_score: float) -> TermScore:
    reward, correct, got = rules.gsm8k_reward(item.response, item.row, mode, format_score)
    return TermScore(reward, correct, f"gsm8k {mode}={got!r} expected={rules.gsm8k_label(item.row)!r}")


def _format(item: ScoreItem, pattern: str, format_score: float) -> TermScore:
    reward = rules.format_reward(item.response, pattern, format_score)
    return TermScore(reward, None, "format match" if reward else "format no match")


def _in_sandbox(term: RewardTerm, item: ScoreItem, sandbox: RewardSandbox) -> TermScore:
    """A custom function (or math-verify) on one sample in the killable child process."""
    if term.kind == "math_verify":
        if not mathverify.available():
            raise RewardFatal(mathverify.MISSING)
        try:
            value = sandbox.call(MATH_VERIFY_FN, [item.prompt, item.response, item.row], term.timeout_s)
        except CallTimeout as err:  # math-verify scores what it cannot decide in time as not equal
            log.warning("math_verify on sample %s: %s: scored 0", item.sample_id, err)
            return TermScore(0.0, False, "math_verify timed out", error=f"math_verify {err}")
        except CallFailed as err:
            raise RewardFatal(f"reward.kind math_verify on sample {item.sample_id}: {err}") from err
        return TermScore(value, value == 1.0, f"math_verify={'equal' if value == 1.0 else 'not equal'}")
    fn = term.function
    assert fn is not None
    try:
        value = sandbox.call(fn, [item.prompt, item.response, item.row], term.timeout_s)
    except (CallTimeout, CallFailed) as err:
        message = f"reward function {fn!r} on sample {item.sample_id} {err}"
        if term.error_policy == "zero":
            log.warning("%s: scored 0 (error_policy zero)", message)
            return TermScore(0.0, None, f"custom={fn} failed", error=message)
        raise RewardFatal(f"{message} (error_policy fail)") from err
    return TermScore(value, None, f"custom={fn}")
