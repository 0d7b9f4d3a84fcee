"""Agent episodes with a real tiny ``transformers`` model generating in this process:
incremental chat templating, loss masks, per-turn records, and a rollout that crashes
mid-episode resuming bitwise equal to the fault-free one without running a tool twice."""

from __future__ import annotations

import copy
import re
from collections import Counter
from functools import cache
from pathlib import Path

import pytest
import torch

from gpu_runtime.data.tool_arithmetic import generate_tool_arithmetic
from gpu_runtime.engine.generate import generate_batch
from gpu_runtime.models.hf_factory import build_hf_model, train_bpe_tokenizer
from gpu_runtime.models.tokenizer import Tokenizer
from gpu_runtime.rollout.agent import records as rec
from gpu_runtime.rollout.agent.chat import IncrementalChat
from gpu_runtime.rollout.agent.episodes import AgentCounters, generate_agent_chunk
from gpu_runtime.rollout.agent.metrics import episode_metrics
from gpu_runtime.rollout.agent.tool_parsers import get_parser
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
TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"
QWEN = (TEMPLATES / "qwen2_5.jinja").read_text()


@cache
def tiny() -> tuple[torch.nn.Module, Tokenizer]:
    tok = Tokenizer(train_bpe_tokenizer(tokenizer_texts(ROWS), 400))
    model = build_hf_model(arch="qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                           tokenizer=tok.hf, seed=0)
    return model, tok


def qwen_tokenizer() -> Tokenizer:
    """The tiny BPE tokenizer with the real Qwen2.5 template, and Qwen's tool tags as tokens of their own."""
    hf = copy.deepcopy(tiny()[1].hf)
    hf.chat_template = QWEN
    hf.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"])
    return Tokenizer(hf)


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


def two_products(n: int) -> list[dict]:
    """Rows asking for two products at once: a hermes model calls the calculator twice in one turn."""
    rows = []
    for i in range(n):
        a, b = (ROWS[j]["messages"][-1]["content"].removeprefix("What is ").removesuffix("?") for j in (i, i + 1))
        rows.append({**ROWS[i], "messages": [{"role": "user", "content": f"What is {a} and {b}?"}]})
    return rows


HERMES_ROWS = two_products(8)


class QwenTwoCalls:
    """A scripted model on the real Qwen2.5 template: its first turn calls the calculator on both
    products of the question (two hermes calls, as this model writes them: back to back), its next
    turn answers with the last ``<tool_response>``. Logprobs are a pure function of the seed."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.end = tok.hf.convert_tokens_to_ids("<|im_end|>")
        self.hermes = get_parser("hermes")

    def reply(self, chat: str) -> str:
        answers = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", chat)
        if answers:
            return answers[-1]
        m = re.search(r"What is (\d+\*\d+) and (\d+\*\d+)\?", chat)
        assert m is not None, chat
        return "".join(self.hermes.render_call("calculator", {"expression": e}) for e in m.groups())

    def __call__(self, prompts: list[list[int]], sp: dict) -> tuple[list[dict], str]:
        out = []
        for i, prompt in enumerate(prompts):
            ids = [*self.tok.encode(self.reply(self.tok.decode(prompt, skip_special=False))), self.end]
            lps = [-((art.derive_seed(sp["sampling_seed"], i, j) % 1000) + 1) / 1000 for j in range(len(ids))]
            out.append({"output_ids": ids, "meta_info": {
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)],
                "finish_reason": {"type": "stop"}}})
        return out, "scripted"


def hermes_rollout(store: LocalStore) -> tuple[art.RolloutChunk, AgentCounters]:
    agent = AgentSpec(tools=["tests.agent_tools:make_counted_calculator"], tool_parser="auto", max_turns=3,
                      max_tokens_per_turn=200, max_episode_tokens=1000)
    rollout = RolloutSpec(prompts_per_step=2, group_size=3, chunk_size=6, max_new_tokens=6, temperature=1.0,
                          top_p=1.0, top_k=-1, agent=agent)
    req = RolloutRequest(run_id="r", step=1, seed=11, policy_version=0, data_cursor=0, n_rows=len(HERMES_ROWS),
                         rollout=rollout)
    counters = AgentCounters()
    chunk = generate_agent_chunk(req, plan_chunks(req)[0], HERMES_ROWS, qwen_tokenizer(),
                                 QwenTwoCalls(qwen_tokenizer()), store, counters)
    return chunk, counters


def test_two_hermes_calls_in_one_turn_run_in_order_each_answered(tmp_path: Path) -> None:
    agent_tools.CALCULATIONS.clear()
    agent_tools.CRASH_ON.clear()
    store = LocalStore(tmp_path)
    chunk, counters = hermes_rollout(store)
    tok = qwen_tokenizer()
    assert counters.tools_run == 12 == len(agent_tools.CALCULATIONS)
    for s in chunk.samples:
        ep = s.episode
        assert ep is not None and (ep.outcome, ep.turns, ep.tool_calls, ep.max_calls_per_turn) == ("completed", 2, 2, 2)
        row = HERMES_ROWS[s.prompt_index]
        exprs = row["messages"][0]["content"].removeprefix("What is ").removesuffix("?").split(" and ")
        # the whole episode is the template applied to the chat: two calls, two tool messages, the answer
        tool_calls = [{"id": f"call00{i:03d}", "type": "function",
                       "function": {"name": "calculator", "arguments": {"expression": x}}} for i, x in enumerate(exprs)]
        answers = [str(int(a) * int(b)) for a, b in (x.split("*") for x in exprs)]
        whole = [*row["messages"], {"role": "assistant", "content": "", "tool_calls": tool_calls},
                 *({"role": "tool", "content": out, "tool_call_id": c["id"], "name": "calculator"}
                   for out, c in zip(answers, tool_calls, strict=True)),
                 {"role": "assistant", "content": answers[-1]}]
        want = tok.hf.apply_chat_template(whole, tools=_schemas(), tokenize=False)
        want = want.replace("</tool_call>\n<tool_call>", "</tool_call><tool_call>")  # as this model writes them
        assert tok.decode(s.prompt_ids + s.response_ids, skip_special=False) == want.removesuffix("\n")
        # the model's tokens train, the two tool answers (one tool turn) do not
        first = art.get_model(store, f"{_prefix()}/ep-{_pos(chunk, s):04d}/turn-00.json",
                              rec.TurnRecord)
        assert [c.arguments for c in first.calls] == exprs and [c.observation for c in first.calls] == answers
        assert s.loss_mask == [1] * len(first.model_ids) + [0] * len(first.env_ids) + [1] * (
            len(s.response_ids) - len(first.model_ids) - len(first.env_ids))
        assert s.response_text == answers[-1]
    # in order: each episode's first call ran before its second
    for i in range(0, 12, 2):
        assert agent_tools.CALCULATIONS[i: i + 2] == [c.arguments for c in art.get_model(
            store, f"{_prefix()}/ep-{i // 2:04d}/turn-00.json", rec.TurnRecord).calls]


@pytest.mark.parametrize("crash_on", [2, 5])
def test_a_crash_between_two_calls_resumes_bitwise_running_only_the_unrecorded_call(
    tmp_path: Path, crash_on: int,
) -> None:
    """The node agent dies inside the second call of a turn (``crash_on`` 2) or the first call of
    another episode's turn (5): the retry reuses every recorded call result and runs only the call
    that was cut off again, ending with the fault-free chunk token for token."""
    agent_tools.CALCULATIONS.clear()
    agent_tools.CRASH_ON[:] = []
    want, _ = hermes_rollout(LocalStore(tmp_path / "clean"))
    clean = list(agent_tools.CALCULATIONS)

    agent_tools.CALCULATIONS.clear()
    agent_tools.CRASH_ON[:] = [crash_on]
    store = LocalStore(tmp_path / "faulty")
    with pytest.raises(agent_tools.Crash):
        hermes_rollout(store)
    assert len(agent_tools.CALCULATIONS) == crash_on
    got, counters = hermes_rollout(store)
    assert agent_tools.CALCULATIONS == clean[:crash_on] + clean[crash_on - 1:]  # only the cut-off call ran again
    assert counters.tools_run == len(clean) - crash_on + 1
    strip = lambda c: [s.model_dump(exclude={"episode"}) for s in c.samples]  # noqa: E731 (seconds differ)
    assert strip(got) == strip(want)
    log = Counter(k.split("/ep-")[1][:4] + k.rsplit("/calls/", 1)[1][:10] for k in store.list("") if "/calls/" in k)
    assert sorted(log.values()) == [1] * (len(clean) - 1) + [2]  # one call logged twice: the one cut off


def _schemas() -> list[dict]:
    from gpu_runtime.rollout.agent.tool_schemas import tool_schemas

    return tool_schemas([agent_tools.make_counted_calculator()])


def _prefix() -> str:
    return rec.episodes_prefix("r", 1, 0)


def _pos(chunk: art.RolloutChunk, s: art.Sample) -> int:
    return chunk.samples.index(s)
