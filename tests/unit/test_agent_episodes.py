"""Agent episodes with a real tiny ``transformers`` model generating in this process:
incremental chat templating, loss masks, per-turn records, and a rollout that crashes
mid-episode resuming bitwise equal to the fault-free one without running a tool twice."""

from __future__ import annotations

from collections import Counter
from functools import cache
from pathlib import Path

import pytest
import torch

from gpu_runtime.data.tool_arithmetic import generate_tool_arithmetic
from gpu_runtime.engine.generate import generate_batch
from gpu_runtime.models.hf_factory import build_hf_model, train_bpe_tokenizer
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.rollout.agent.chat import IncrementalChat
from gpu_runtime.rollout.agent.episodes import AgentCounters, generate_agent_chunk
from gpu_runtime.rollout.agent.metrics import episode_metrics
from gpu_runtime.rollout.chunks import plan_chunks
from gpu_runtime.rollout.request import RolloutRequest
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.object_store import LocalStore
from gpu_runtime.trainer.base_model import tokenizer_texts
from gpu_runtime.trainer.common.batches import MicroBatch, response_aligned_mask
from spec.agent import AgentSpec
from spec.rollout import RolloutSpec
from tests import agent_tools

ROWS = generate_tool_arithmetic(40, 3, 99, "*", min_operand=10)


@cache
def tiny() -> tuple[torch.nn.Module, Tokenizer]:
    tok = Tokenizer(train_bpe_tokenizer(tokenizer_texts(ROWS), 400))
    model = build_hf_model(arch="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                           tokenizer=tok.hf, seed=0)
    return model, tok


class Engine:
    """``generate_batch`` behind the rollout's generator signature (SGLang-shaped results);
    ``fail_on`` makes call number k raise, as a dead engine's request does."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.calls = 0
        self.fail_on = fail_on

    def __call__(self, prompts: list[list[int]], sp: dict) -> tuple[list[dict], str]:
        self.calls += 1
        if self.fail_on == self.calls:
            raise ConnectionError("engine died")
        model, tok = tiny()
        res = generate_batch(model, prompts, max_new_tokens=sp["max_new_tokens"], temperature=sp["temperature"],
                             seed=sp["sampling_seed"], eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                             stop_token_ids=sp["stop_token_ids"])
        return [{"output_ids": r.output_ids, "meta_info": {
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(r.logprobs, r.output_ids)],
            "finish_reason": {"type": r.finish_reason}}} for r in res], "in-process"


def settings(**kw: object) -> AgentSpec:
    base = dict(tools=["calculator"], environment="tests.agent_tools:every_turn_calls", max_turns=3,
                max_tokens_per_turn=6, max_episode_tokens=60, tool_timeout_s=5.0, episode_timeout_s=600.0,
                on_tool_error="continue", tool_role="tool")
    return AgentSpec(**(base | kw))


def request(agent: AgentSpec) -> RolloutRequest:
    rollout = RolloutSpec(prompts_per_step=2, group_size=3, chunk_size=6, max_new_tokens=6, temperature=1.0,
                          top_p=1.0, top_k=-1, agent=agent)
    return RolloutRequest(run_id="r", step=1, seed=11, policy_version=0, data_cursor=0, n_rows=len(ROWS), rollout=rollout)


def rollout(store: LocalStore, engine: Engine, agent: AgentSpec | None = None) -> tuple[art.RolloutChunk, AgentCounters]:
    req = request(agent or settings())
    counters = AgentCounters()
    chunk = generate_agent_chunk(req, plan_chunks(req)[0], ROWS, tiny()[1], engine, store, counters)
    return chunk, counters


def test_tool_turn_tokens_are_the_chat_template_delta() -> None:
    _, tok = tiny()
    chat = IncrementalChat(tok, "tool")
    messages = ROWS[0]["messages"]
    call = "<calculator>12*34</calculator>"
    model_ids = tok.encode(call) + [chat.end_of_turn]
    incremental = chat.prompt(messages) + model_ids + chat.tool_turn(model_ids, "408")
    whole = tok.encode_chat([*messages, {"role": "assistant", "content": call}, {"role": "tool", "content": "408"}])
    assert incremental == whole
    # a turn that stopped on EOS (not the end-of-turn token) gets the end-of-turn token as a tool-turn token
    assert chat.tool_turn(tok.encode(call), "408")[0] == chat.end_of_turn
    assert tok.eos_token_id in chat.stop_ids and chat.end_of_turn in chat.stop_ids


def test_episodes_are_incremental_and_masked(tmp_path: Path) -> None:
    agent_tools.ENVIRONMENTS.clear()
    chunk, counters = rollout(LocalStore(tmp_path), Engine())
    _, tok = tiny()
    for s in chunk.samples:
        ep = s.episode
        assert ep is not None and len(s.loss_mask) == len(s.response_ids) == len(s.logprobs)
        # model tokens train (mask 1), tool-turn tokens never do (mask 0, logprob 0)
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask) if m == 0)
        assert sum(1 for m in s.loss_mask if m == 0) > 0 == (ep.turns == 1)
        assert ep.outcome in ("truncated", "completed") and ep.turns <= 3
        # every turn but the last called the environment, which gave a per-turn reward
        assert ep.tool_calls == ep.turns - 1 if ep.outcome == "truncated" and ep.turns == 3 else True
        assert ep.turn_rewards[: ep.tool_calls] == [0.5] * ep.tool_calls
        assert s.response_text == tok.decode(s.response_ids[len(s.response_ids) - _last_turn_len(s):])
    m = episode_metrics(chunk.samples)
    assert m["episodes"] == 6 and m["tool_calls"] == counters.tools_run == sum(len(e.executed) for e in agent_tools.ENVIRONMENTS)
    assert m["tool_calls"] > 0 and 1 <= m["turns_mean"] <= 3


def _last_turn_len(s: art.Sample) -> int:
    n = 0
    for m in reversed(s.loss_mask):
        if m == 0:
            break
        n += 1
    return n


@pytest.mark.parametrize("fail_on", [2, 3])
def test_a_crash_mid_episode_resumes_bitwise_without_running_a_tool_twice(tmp_path: Path, fail_on: int) -> None:
    """The engine dies on the k-th turn batch; the retried rollout (same store) resumes every
    episode at its last finished turn and ends with the fault-free chunk, token for token."""
    agent_tools.ENVIRONMENTS.clear()
    want, _ = rollout(LocalStore(tmp_path / "clean"), Engine())
    clean_runs = sum(len(e.executed) for e in agent_tools.ENVIRONMENTS)

    agent_tools.ENVIRONMENTS.clear()
    store = LocalStore(tmp_path / "faulty")
    with pytest.raises(ConnectionError):
        rollout(store, Engine(fail_on=fail_on))
    before = sum(len(e.executed) for e in agent_tools.ENVIRONMENTS)
    got, counters = rollout(store, Engine())
    after = sum(len(e.executed) for e in agent_tools.ENVIRONMENTS)
    assert before > 0 and counters.turns_reused > 0
    assert after == clean_runs  # the tools ran as often as in the fault-free rollout
    strip = lambda c: [s.model_dump(exclude={"episode"}) for s in c.samples]  # noqa: E731 (seconds differ)
    assert strip(got) == strip(want)
    log = [k.rsplit("/calls/", 1)[1][:7] + k.split("/calls/")[0][-7:] for k in store.list("") if "/calls/" in k]
    assert log and max(Counter(log).values()) == 1  # one execution per (episode, turn)


def test_a_stored_model_turn_is_not_regenerated(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    want, _ = rollout(store, Engine())
    for k in store.list(""):  # forget the finished turns and the chunk, keep the model turn batches
        if "/ep-" in k and "/calls/" not in k:
            store.delete(k)
    engine = Engine()
    got, counters = rollout(store, engine)
    assert engine.calls == 0 and counters.model_turns_reused >= 1
    assert [s.response_ids for s in got.samples] == [s.response_ids for s in want.samples]


def test_limits_end_episodes_with_their_outcome(tmp_path: Path) -> None:
    chunk, _ = rollout(LocalStore(tmp_path / "a"), Engine(), settings(max_turns=1))
    assert {s.episode.outcome for s in chunk.samples} <= {"truncated", "completed"}
    assert all(s.episode.tool_calls == 0 for s in chunk.samples)  # a call on the last turn is not run
    chunk, _ = rollout(LocalStore(tmp_path / "b"), Engine(), settings(episode_timeout_s=1e-9))
    assert {s.episode.outcome for s in chunk.samples} == {"timeout"}
    chunk, _ = rollout(LocalStore(tmp_path / "c"), Engine(), settings(max_tokens_per_turn=6, max_episode_tokens=8))
    assert all(len(s.response_ids) <= 8 and s.episode.outcome == "truncated" for s in chunk.samples)


def test_loss_mask_reaches_the_trainer_layout() -> None:
    s = art.Sample(sample_id="x", prompt_index=0, group_index=0, prompt_ids=[1, 2, 3], response_ids=[4, 5, 6, 7, 8],
                   logprobs=[-1.0, -1.0, 0.0, 0.0, -1.0], weight_version=0, finish_reason="stop",
                   loss_mask=[1, 1, 0, 0, 1])
    plain = s.model_copy(update={"loss_mask": None, "sample_id": "y"})
    b = MicroBatch.of([s, plain], pad_id=0)
    # targets are tokens 1..7 of prompt+response; the response starts at target index 2
    assert b.tmask[0].tolist() == [False, False, True, True, False, False, True]
    assert b.tmask[1].tolist() == [False, False, True, True, True, True, True]
    assert response_aligned_mask([s, plain]).tolist() == [[True, True, False, False, True], [True] * 5]
    with pytest.raises(ValueError, match="loss_mask has 2 entries"):
        MicroBatch.of([s.model_copy(update={"loss_mask": [1, 0]})], pad_id=0)
