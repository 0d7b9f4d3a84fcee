"""Two tool calls in one turn, as ``examples/agent_two_calls.yaml`` trains them (``tool_arithmetic``
with ``terms: 2``, Hermes / Qwen2.5 calls): "What is a*b + c*d?" — both products called in ONE
turn, each answered by its own tool message, then the sum called, then the answer. Run by the
built-in loop (``kind: tools``, ``tool_parser: hermes``) and by the ReAct example agent through the
endpoint (``kind: openai``), with a scripted model that writes the demonstration's turns."""

from __future__ import annotations

from pathlib import Path

from gpu_runtime.data.tool_arithmetic import generate_tool_arithmetic
from gpu_runtime.rollout.agent import openai_records as orec
from gpu_runtime.rollout.agent import records as rec
from gpu_runtime.rollout.agent.episodes import generate_agent_chunk
from gpu_runtime.rollout.agent.openai_chunk import generate_openai_chunk
from gpu_runtime.rollout.chunks import plan_chunks
from gpu_runtime.rollout.request import RolloutRequest
from gpu_runtime.store import artifacts as art
from gpu_runtime.store.object_store import LocalStore
from spec.agent import AgentSpec
from spec.rollout import RolloutSpec
from tests.scripted_model import ScriptedModel
from tests.unit.test_agent_episodes import tiny

ROWS = generate_tool_arithmetic(8, 1, 99, "*", min_operand=10, terms=2, tool_format="hermes")


def request(agent: AgentSpec) -> RolloutRequest:
    rollout = RolloutSpec(prompts_per_step=2, group_size=2, chunk_size=4, temperature=1.0, top_p=1.0, top_k=-1,
                          agent=agent)
    return RolloutRequest(run_id="r", step=1, seed=9, policy_version=0, data_cursor=0, n_rows=len(ROWS),
                          rollout=rollout)


def expected(row: dict) -> tuple[str, str, int]:
    question = row["messages"][-1]["content"].removeprefix("What is ").removesuffix("?")
    first, second = question.split(" + ")
    return first, second, int(row["answer"].removeprefix("#### "))


def test_the_built_in_loop_runs_both_calls_of_a_turn_in_order(tmp_path: Path) -> None:
    _, tok = tiny()
    agent = AgentSpec(tools=["calculator"], tool_parser="hermes", max_turns=3, max_tokens_per_turn=200,
                      max_episode_tokens=600)
    req = request(agent)
    store = LocalStore(tmp_path)
    chunk = generate_agent_chunk(req, plan_chunks(req)[0], ROWS, tok, ScriptedModel(tok, hermes=True), store)
    for pos, s in enumerate(chunk.samples):
        first, second, total = expected(ROWS[s.prompt_index])
        assert s.episode is not None and s.episode.outcome == "completed" and s.episode.turns == 3
        assert s.episode.tool_calls == 3 and s.response_text == str(total)
        turn0 = art.get_model(store, rec.turn_key(rec.episodes_prefix("r", 1, 0), pos, 0), rec.TurnRecord)
        assert [(c.tool, c.arguments, c.executed) for c in turn0.calls] == [
            ("calculator", first, True), ("calculator", second, True)]
        a, b = (int(eval(e)) for e in (first, second))  # noqa: S307 - two products of test integers
        assert [c.observation for c in turn0.calls] == [str(a), str(b)]
        # one tool message per call, in order, as the template renders them after the model's turn
        assert tok.decode(turn0.env_ids, skip_special=False) == (
            f"\n<|im_start|>tool\n{a}<|im_end|>\n<|im_start|>tool\n{b}<|im_end|>\n<|im_start|>assistant\n")


def test_the_openai_agent_gets_both_calls_in_one_message(tmp_path: Path) -> None:
    _, tok = tiny()
    agent = AgentSpec(kind="openai", entrypoint="examples.agents.react_calculator:run", tool_parser="hermes",
                      max_calls=4, max_tokens_per_turn=200, max_episode_tokens=600, episode_timeout_s=60.0)
    req = request(agent)
    store = LocalStore(tmp_path)
    chunk = generate_openai_chunk(req, plan_chunks(req)[0], ROWS, tok, ScriptedModel(tok, hermes=True), store)
    for pos, s in enumerate(chunk.samples):
        first, second, total = expected(ROWS[s.prompt_index])
        assert s.episode is not None and s.episode.outcome == "completed", s.episode
        assert s.episode.turns == 3 and s.episode.tool_calls == 3 and s.response_text == str(total)
        call0 = art.get_model(store, orec.call_key(rec.episodes_prefix("r", 1, 0), pos, 0), orec.CallRecord)
        calls = call0.response["choices"][0]["message"]["tool_calls"]
        assert [c["function"]["arguments"] for c in calls] == [
            f'{{"expression": "{first}"}}', f'{{"expression": "{second}"}}']


def test_the_demonstrations_call_is_what_the_hermes_parser_writes_and_reads() -> None:
    from gpu_runtime.data.tool_arithmetic import hermes_call
    from gpu_runtime.rollout.agent.tool_parsers import get_parser
    from gpu_runtime.rollout.agent.tool_schemas import tool_schemas
    from gpu_runtime.rollout.agent.tools import load_tools

    hermes = get_parser("hermes")
    assert hermes_call("12*34") == hermes.render_call("calculator", {"expression": "12*34"})
    turn = hermes.parse(hermes_call("12*34") + hermes_call("5*6"), tool_schemas(load_tools(["calculator"], 5.0).values()))
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [
        ("calculator", {"expression": "12*34"}, ""), ("calculator", {"expression": "5*6"}, "")]
