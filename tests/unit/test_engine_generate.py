"""Batched KV-cache generation: equals full recompute, deterministic, per-sample seeds."""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from gpu_runtime.engine.generate import GenResult, generate_batch, model_device
from gpu_runtime.models.causal_lm import lm_logits, positions_from_mask
from tests.engine_fixtures import _tokenizer, tiny_model

TOK = _tokenizer()
PROMPTS = [TOK.encode("12+7="), TOK.encode("3*4="), TOK.encode("a"), TOK.encode("(9-2)*3=")]


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    """Both architectures through the same generation code (transformers implementations)."""
    torch.set_num_threads(1)
    return tiny_model(seed=3, arch=request.param)[0].eval()


@torch.no_grad()
def greedy_full_recompute(
    model: PreTrainedModel, prompt: list[int], *, max_new_tokens: int, eos_id: int | None = None
) -> GenResult:
    """Reference: greedy decoding of ONE prompt recomputing the whole sequence each
    token (no cache, no padding), to check the cached path against."""
    out = GenResult()
    seq = list(prompt)
    for _ in range(max_new_tokens):
        ids = torch.tensor([seq], dtype=torch.long, device=model_device(model))
        mask = torch.ones_like(ids, dtype=torch.bool)
        logits = lm_logits(model, ids, mask, positions_from_mask(mask))[0, -1].cpu()
        tok = int(torch.argmax(logits).item())
        out.output_ids.append(tok)
        out.logprobs.append(float(torch.log_softmax(logits, -1)[tok].item()))
        seq.append(tok)
        if eos_id is not None and tok == eos_id:
            out.finish_reason = "stop"
            break
    return out


def _gen(model, prompts, **kw):
    args = dict(max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=-1, seed=7,
                eos_id=TOK.eos_token_id, pad_id=TOK.pad_token_id)
    args.update(kw)
    return generate_batch(model, prompts, **args)


def test_kv_cache_greedy_equals_full_recompute(model) -> None:
    batch = _gen(model, PROMPTS, temperature=0.0, max_new_tokens=16)
    for prompt, got in zip(PROMPTS, batch):
        ref = greedy_full_recompute(model, prompt, max_new_tokens=16, eos_id=TOK.eos_token_id)
        assert got.output_ids == ref.output_ids
        assert got.finish_reason == ref.finish_reason
        assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-4)


def test_same_batch_twice_is_bitwise_identical(model) -> None:
    for kw in ({}, {"top_p": 0.8, "top_k": 20, "temperature": 0.7}):
        a, b = _gen(model, PROMPTS, **kw), _gen(model, PROMPTS, **kw)
        assert [r.output_ids for r in a] == [r.output_ids for r in b]
        assert [r.logprobs for r in a] == [r.logprobs for r in b]
        assert [r.finish_reason for r in a] == [r.finish_reason for r in b]


def test_seed_changes_samples_and_results_are_well_formed(model) -> None:
    a, b = _gen(model, PROMPTS, seed=1), _gen(model, PROMPTS, seed=2)
    assert [r.output_ids for r in a] != [r.output_ids for r in b]
    for r in a:
        assert len(r.output_ids) == len(r.logprobs) <= 12
        assert all(lp <= 0.0 for lp in r.logprobs)
        if r.finish_reason == "stop":
            assert r.output_ids[-1] == TOK.eos_token_id
            assert TOK.eos_token_id not in r.output_ids[:-1]
        else:
            assert len(r.output_ids) == 12


def test_sample_depends_on_its_own_index_not_on_neighbours(model) -> None:
    """Sample i's random stream is derive_seed(seed, i): identical prompts at different
    indices differ, and changing a neighbour's prompt (same batch shape) leaves sample 0
    on the same random stream (tokens equal whenever the batch floats are equal)."""
    same = [PROMPTS[0]] * 4
    out = _gen(model, same, max_new_tokens=20)
    assert len({tuple(r.output_ids) for r in out}) > 1
    # greedy: every copy of the same prompt gives the same tokens
    g = _gen(model, same, temperature=0.0)
    assert len({tuple(r.output_ids) for r in g}) == 1
    # a neighbour with the same length but different tokens: sample 0 unchanged
    other = list(PROMPTS[0])
    other[1] = TOK.encode("9")[0]
    a = _gen(model, [PROMPTS[0], PROMPTS[0]])
    b = _gen(model, [PROMPTS[0], other])
    assert a[0].output_ids == b[0].output_ids
    assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-5)


def test_top_k_one_is_greedy_and_stop_tokens_end_a_sample(model) -> None:
    greedy = _gen(model, PROMPTS, temperature=0.0)
    topk1 = _gen(model, PROMPTS, top_k=1, seed=99)
    assert [r.output_ids for r in greedy] == [r.output_ids for r in topk1]
    first = greedy[0].output_ids[0]
    stopped = _gen(model, PROMPTS[:1], temperature=0.0, stop_token_ids=[first])
    assert stopped[0].output_ids == [first] and stopped[0].finish_reason == "stop"
    assert _gen(model, PROMPTS, max_new_tokens=0)[0].output_ids == []


def _stop_string_of(out_ids: list[int], k: int) -> str:
    """The shortest suffix of the text through token ``k`` that the text before it lacks:
    a stop string that token k completes."""
    before, text = TOK.decode(out_ids[:k]), TOK.decode(out_ids[: k + 1])
    assert len(text) > len(before), "token k adds no text"
    return next(text[-n:] for n in range(1, len(text) + 1) if text[-n:] not in before)


def test_stop_strings_end_a_sample_at_the_token_that_completes_them(model) -> None:
    """Sample 1's text is cut at a stop string its token 3 completes (the token kept); the
    other samples, and sample 1's tokens before the stop, are those of the run without it."""
    free = _gen(model, PROMPTS, max_new_tokens=12)
    victim = next(i for i, r in enumerate(free) if len(r.output_ids) >= 5 and r.finish_reason == "length")
    stop = _stop_string_of(free[victim].output_ids, 3)
    cut = _gen(model, PROMPTS, max_new_tokens=12, stop=[stop], decode=TOK.decode)
    r = cut[victim]
    assert r.output_ids == free[victim].output_ids[:4] and r.finish_reason == "stop" and r.matched == stop
    assert stop in TOK.decode(r.output_ids)  # kept in the output
    assert r.logprobs == pytest.approx(free[victim].logprobs[:4], abs=1e-5) and len(r.logprobs) == 4
    for i, (a, b) in enumerate(zip(free, cut)):
        if i != victim and stop not in TOK.decode(a.output_ids):
            assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
    # seeded sampling with stops stays bitwise deterministic
    again = _gen(model, PROMPTS, max_new_tokens=12, stop=[stop], decode=TOK.decode, stop_token_ids=[5])
    twice = _gen(model, PROMPTS, max_new_tokens=12, stop=[stop], decode=TOK.decode, stop_token_ids=[5])
    assert [(x.output_ids, x.logprobs, x.finish_reason, x.matched) for x in again] == [
        (x.output_ids, x.logprobs, x.finish_reason, x.matched) for x in twice]
    with pytest.raises(ValueError, match="decode"):
        _gen(model, PROMPTS, stop=["x"])


def test_stop_token_ids_report_the_matched_token(model) -> None:
    free = _gen(model, PROMPTS[:1], max_new_tokens=12, temperature=0.0)[0]
    tok = free.output_ids[2]
    k = free.output_ids.index(tok)
    r = _gen(model, PROMPTS[:1], max_new_tokens=12, temperature=0.0, stop_token_ids=[tok])[0]
    assert r.output_ids == free.output_ids[: k + 1] and (r.finish_reason, r.matched) == ("stop", tok)


def test_stop_string_hit_counts_a_string_once_its_last_character_arrives() -> None:
    from gpu_runtime.engine.generate import stop_string_hit

    assert stop_string_hit("The answer", 7, ["answer"]) == ("answer", 10)  # "ans" + "wer": completed now
    assert stop_string_hit("x = 4\nmore", 3, ["\n"]) == ("\n", 10)  # a token carrying more text after it
    assert stop_string_hit("abc", 3, ["b"]) == (None, 3)  # already before the newest token: not new
    assert stop_string_hit("ab", 1, ["zz", "b"]) == ("b", 2)
    assert stop_string_hit("", 0, ["a"]) == (None, 0)
