"""The OpenAI-compatible agent endpoint (``rollout.agent.kind: openai``, docs/agents.md), driven by
the real ``openai`` SDK over real HTTP, and whole chunks of episodes run by agent programs in child
processes (``tests/agent_programs.py``, ``examples/agents/react_calculator.py``).

The model is scripted (``tests/scripted_model.py``): it answers the calculator task with real
tool calls, and its logprobs are a function of each call's seed, so a call generated twice or
with another seed shows in the numbers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import openai
import pytest

from gpu_runtime.proc.processes import pid_alive
from gpu_runtime.rollout.agent import openai_records as orec
from gpu_runtime.rollout.agent.openai_chunk import OpenAICounters, generate_openai_chunk
from gpu_runtime.rollout.agent.openai_server import AgentEndpoint
from gpu_runtime.rollout.agent.openai_session import Chats, EpisodeSession, SessionCounters
from gpu_runtime.rollout.agent.tool_parsers import get_parser
from gpu_runtime.rollout.chunks import plan_chunks
from gpu_runtime.rollout.request import RolloutRequest
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.object_store import LocalStore
from spec.agent import AgentSpec
from spec.rollout import RolloutSpec
from tests.scripted_model import ScriptedModel
from tests.unit.test_agent_episodes import ROWS, tiny

REACT = "examples.agents.react_calculator:run"


def request(**agent: object) -> RolloutRequest:
    spec = AgentSpec(**({"kind": "openai", "entrypoint": REACT, "max_tokens_per_turn": 24, "max_episode_tokens": 96,
                         "episode_timeout_s": 60.0} | agent))
    rollout = RolloutSpec(prompts_per_step=2, group_size=2, chunk_size=4, temperature=1.0, top_p=1.0, top_k=-1,
                          agent=spec)
    return RolloutRequest(run_id="r", step=1, seed=5, policy_version=0, data_cursor=0, n_rows=len(ROWS),
                          rollout=rollout)


def chunk_of(store: LocalStore, model: ScriptedModel, counters: OpenAICounters | None = None,
             **agent: object) -> art.RolloutChunk:
    req = request(**agent)
    return generate_openai_chunk(req, plan_chunks(req)[0], ROWS, tiny()[1], model, store, counters)


@pytest.fixture()
def served(tmp_path: Path):  # one episode's session behind a live endpoint, and an SDK client for it
    _, tok = tiny()
    req = request()
    assert req.rollout.agent is not None
    model = ScriptedModel(tok)
    store = LocalStore(tmp_path)
    from gpu_runtime.rollout.agent.openai_chunk import _one

    session = EpisodeSession(
        pos=0, seed=7, prefix="runs/r/ep", store=store, rollout=req.rollout, settings=req.rollout.agent,
        tokenizer=tok, chats=Chats(tok, "tool"), parser=get_parser("tags", tok.chat_template),
        generate=lambda p, sp: _one(req, plan_chunks(req)[0], model, p, sp),
        counters=SessionCounters())
    with AgentEndpoint() as endpoint:
        session.start_attempt()
        client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.admit(session), max_retries=0)
        yield session, client, model, store, endpoint


def ask(client: openai.OpenAI, messages: list[dict], **kw: object):
    from examples.agents.react_calculator import CALCULATOR

    return client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], **kw)


def test_a_call_returns_openai_tool_calls_and_is_recorded_before_it_returns(served) -> None:
    session, client, model, store, _ = served
    reply = ask(client, ROWS[0]["messages"])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    a, b = ROWS[0]["messages"][-1]["content"].removeprefix("What is ").removesuffix("?").split("*")
    assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": f"{a}*{b}"}
    assert len(call.id) == 9 and call.id.isalnum()  # what the strictest templates (Mistral's) accept
    record = art.get_model(store, orec.call_key("runs/r/ep", 0, 0), orec.CallRecord)
    assert record.response == reply.model_dump(exclude_unset=True) | {"choices": record.response["choices"]}
    assert reply.usage is not None and reply.usage.completion_tokens == len(record.completion_ids)
    assert record.prompt_ids == tiny()[1].encode_chat(ROWS[0]["messages"]) and not record.extends


def test_the_next_call_extends_the_tokens_without_retokenising(served) -> None:
    session, client, model, store, _ = served
    messages = list(ROWS[0]["messages"])
    first = ask(client, messages).choices[0].message
    messages.append(first.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "1234"})
    second = ask(client, messages, logprobs=True)
    assert second.choices[0].message.content == "1234" and second.choices[0].finish_reason == "stop"
    r0, r1 = session.records()
    assert r1.extends and r1.prompt_ids[: len(r0.prompt_ids) + len(r0.completion_ids)] == r0.prompt_ids + r0.completion_ids
    # the delta is the template's own rendering of the tool message after the model's turn
    _, tok = tiny()
    assert tok.decode(r1.prompt_ids[len(r0.prompt_ids) + len(r0.completion_ids):], skip_special=False) == (
        "\n<|im_start|>tool\n1234<|im_end|>\n<|im_start|>assistant\n")
    lp = second.choices[0].logprobs
    assert lp is not None and [t.logprob for t in lp.content] == r1.logprobs


def test_a_replayed_call_returns_the_record_without_generating(served) -> None:
    session, client, model, store, endpoint = served
    want = ask(client, ROWS[0]["messages"])
    n = model.calls
    session.start_attempt()  # the agent runs again (its process was killed)
    again = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.admit(session), max_retries=0)
    assert ask(again, ROWS[0]["messages"]).model_dump() == want.model_dump()
    assert model.calls == n and session.counters.replayed == 1
    with pytest.raises(openai.AuthenticationError):  # the killed attempt's key opens nothing now
        ask(client, ROWS[0]["messages"])


def test_a_request_that_differs_from_its_record_is_generated_afresh(served) -> None:
    session, client, model, store, endpoint = served
    ask(client, ROWS[0]["messages"])
    ask(client, [*ROWS[0]["messages"], {"role": "user", "content": "again"}])
    session.start_attempt()
    again = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.admit(session), max_retries=0)
    ask(again, ROWS[1]["messages"])  # not what call 0 asked: records 0 and 1 are dropped
    assert session.counters.diverged == 1 and model.calls == 3
    assert not store.exists(orec.call_key("runs/r/ep", 0, 1))
    assert art.get_model(store, orec.call_key("runs/r/ep", 0, 0), orec.CallRecord).prompt_ids == (
        tiny()[1].encode_chat(ROWS[1]["messages"]))


@pytest.mark.parametrize(("kw", "error", "param"), [
    ({"model": "gpt-4o"}, openai.NotFoundError, "model"),
    ({"n": 2}, openai.BadRequestError, "n"),
    ({"temperature": 0.2}, openai.BadRequestError, "temperature"),
    ({"tool_choice": "required"}, openai.BadRequestError, "tool_choice"),
    ({"extra_body": {"best_of": 3}}, openai.BadRequestError, "best_of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     openai.BadRequestError, "messages[0].content[0]"),
])
def test_requests_it_cannot_serve_get_openai_errors_naming_the_field(served, kw: dict, error: type, param: str) -> None:
    _, client, model, _, _ = served
    args = {"model": "policy", "messages": ROWS[0]["messages"]} | kw
    with pytest.raises(error) as e:
        client.chat.completions.create(**args)
    assert e.value.body["param"] == param, e.value.body  # type: ignore[index]
    assert param in e.value.body["message"] or param == "model"  # type: ignore[index]
    assert model.calls == 0


def test_streaming_and_the_call_budget_are_refused(served) -> None:
    session, client, _, _, _ = served
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.chat.completions.create(model="policy", messages=ROWS[0]["messages"], stream=True)
    session.settings = session.settings.model_copy(update={"max_calls": 1})
    ask(client, ROWS[0]["messages"])
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, ROWS[0]["messages"])
    assert e.value.body["code"] == "max_calls"  # type: ignore[index]
    assert [m.id for m in client.models.list()] == ["policy"]


def test_a_chunk_of_react_agents_trains_their_tokens(tmp_path: Path) -> None:
    _, tok = tiny()
    model = ScriptedModel(tok)
    counters = OpenAICounters()
    chunk = chunk_of(LocalStore(tmp_path), model, counters)
    assert counters.generated == model.calls == 8 and counters.replayed == 0  # 4 episodes x (call + answer)
    for s in chunk.samples:
        ep = s.episode
        assert ep is not None and ep.outcome == "completed" and ep.turns == 2 and ep.tool_calls == 1
        a, b = ROWS[s.prompt_index]["messages"][-1]["content"][8:-1].split("*")
        assert s.response_text == str(int(a) * int(b))  # what run() returned: the model's answer
        # the loss covers the model's tokens only: call, end-of-turn, answer, end-of-turn
        model_text = tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if m], skip_special=False)
        assert model_text == f"<calculator>{a}*{b}</calculator><|im_end|>{int(a) * int(b)}<|im_end|>"
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask) if not m)
        assert s.prompt_ids == tok.encode_chat(ROWS[s.prompt_index]["messages"])


def test_a_rerun_rollout_replays_every_call_and_ends_bitwise(tmp_path: Path) -> None:
    """The rollout dies after its episodes ended: the retry runs no agent again. Then the episodes'
    ends are forgotten too: the retry re-runs the agents and every call is answered from the record."""
    _, tok = tiny()
    store = LocalStore(tmp_path)
    want = chunk_of(store, ScriptedModel(tok))
    model, counters = ScriptedModel(tok), OpenAICounters()
    assert chunk_of(store, model, counters) == want and counters.episodes_reused == 4 and model.calls == 0
    for key in store.list(""):
        if key.endswith("/episode.json"):
            store.delete(key)
    model, counters = ScriptedModel(tok), OpenAICounters()
    got = chunk_of(store, model, counters)
    assert model.calls == 0 and counters.replayed == 8 and counters.generated == 0
    strip = lambda c: [s.model_dump(exclude={"episode"}) for s in c.samples]  # noqa: E731 (seconds differ)
    assert strip(got) == strip(want)


def test_an_agent_killed_from_outside_is_restarted_and_replayed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, tok = tiny()
    want = chunk_of(LocalStore(tmp_path / "clean"), ScriptedModel(tok))
    monkeypatch.setenv("MILESTONE_TEST_MARKS", str(tmp_path))
    model, counters = ScriptedModel(tok), OpenAICounters()
    store = LocalStore(tmp_path / "killed")
    got = chunk_of(store, model, counters, entrypoint="tests.agent_programs:dies_once")
    # one episode per row died (the first of its group to get there): restarted, its call replayed
    assert counters.agent_restarts == 2 and counters.replayed == 2 and model.calls == 8
    strip = lambda c: [s.model_dump(exclude={"episode"}) for s in c.samples]  # noqa: E731
    assert strip(got) == strip(want)
    gens = [k for k in store.list("") if "/gen/" in k]
    assert len(gens) == 8 and len({k.rsplit("-", 1)[0] for k in gens}) == 8  # no recorded call generated twice
    ends = [art.get_model(store, k, orec.EpisodeEnd) for k in store.list("") if k.endswith("episode.json")]
    assert sorted(e.attempts for e in ends) == [1, 1, 2, 2] and {e.status for e in ends} == {"completed"}


@pytest.mark.parametrize(("entrypoint", "outcome"), [
    ("tests.agent_programs:raises", "agent_error"), ("tests.agent_programs:hangs", "timeout"),
    ("tests.agent_programs:never_calls", "no_calls"),
])
def test_a_failing_agent_ends_its_episode_and_never_the_step(tmp_path: Path, entrypoint: str, outcome: str) -> None:
    _, tok = tiny()
    # only the hanging agent needs a short budget: the others end on their own (a loaded machine must not time them out)
    chunk = chunk_of(LocalStore(tmp_path), ScriptedModel(tok), entrypoint=entrypoint,
                     episode_timeout_s=3.0 if outcome == "timeout" else 60.0)
    for s in chunk.samples:
        assert s.episode is not None and s.episode.outcome == outcome and s.episode.zero_reward
        assert len(s.response_ids) == len(s.loss_mask) == len(s.logprobs) >= 1
    if outcome == "agent_error":
        assert "the agent's own bug" in chunk.samples[0].episode.error  # type: ignore[union-attr]
        assert chunk.samples[0].loss_mask and sum(chunk.samples[0].loss_mask) > 0  # its call's tokens are kept


def test_an_agent_that_edits_its_history_trains_its_last_segment(tmp_path: Path) -> None:
    _, tok = tiny()
    chunk = chunk_of(LocalStore(tmp_path), ScriptedModel(tok), entrypoint="tests.agent_programs:edits_history")
    for s in chunk.samples:
        assert s.episode is not None and s.episode.segments == 2 and s.episode.turns == 2
        assert tok.decode(s.prompt_ids).startswith("user\nAnswer with the number only.") or \
            "Answer with the number only." in tok.decode(s.prompt_ids)
        assert all(s.loss_mask)  # one call: all model tokens


def test_the_endpoint_never_outlives_its_chunk(tmp_path: Path) -> None:
    with AgentEndpoint() as endpoint:
        url = endpoint.base_url
    with pytest.raises(openai.APIConnectionError):
        openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=2).models.list()
    assert url.startswith("http://127.0.0.1:")
    assert os.environ.get("OPENAI_API_KEY") is None or True


def test_an_entrypoint_that_does_not_import_ends_each_episode_naming_it(tmp_path: Path) -> None:
    _, tok = tiny()
    chunk = chunk_of(LocalStore(tmp_path), ScriptedModel(tok), entrypoint="tests.agent_programs:missing")
    for s in chunk.samples:
        assert s.episode is not None and s.episode.outcome == "agent_error"
        assert "rollout.agent.entrypoint 'tests.agent_programs:missing': AttributeError" in s.episode.error


def test_a_killed_zygote_restarts_its_episodes_which_replay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The zygote that forks a chunk's agents is SIGKILLed mid-chunk: the ends of the episodes it
    forked are unknown, so they are killed and restarted from a new zygote, their calls replayed;
    the chunk equals the fault-free one and no agent process is left behind."""
    _, tok = tiny()
    want = chunk_of(LocalStore(tmp_path / "clean"), ScriptedModel(tok))
    monkeypatch.setenv("MILESTONE_TEST_MARKS", str(tmp_path))
    model, counters = ScriptedModel(tok), OpenAICounters()
    store = LocalStore(tmp_path / "killed")
    got = chunk_of(store, model, counters, entrypoint="tests.agent_programs:kills_its_zygote_once")
    assert counters.agent_restarts >= 1 and model.calls == 8
    strip = lambda c: [s.model_dump(exclude={"episode"}) for s in c.samples]  # noqa: E731
    assert strip(got) == strip(want)
    pids = [json.loads(store.get_bytes(k))["pid"] for k in store.list("") if "/agent-" in k]
    assert pids and not [p for p in pids if pid_alive(p)]  # every agent process was stopped
