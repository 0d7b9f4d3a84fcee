"""Tool-call parsers (``tool_parsers``) and tool schemas (``tool_schemas``): each family's calls read back
(several a turn, malformed, unknown, cut off, with content around them), detection from real chat
templates (tests/data/chat_templates), and the real Qwen2.5 template continued one turn at a time
with two calls and their two answers equal to the template applied to the whole chat."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import ClassVar

import pytest

from gpu_runtime.models.hf_factory import CHATML_TEMPLATE
from gpu_runtime.rollout.agent.chat import IncrementalChat
from gpu_runtime.rollout.agent.tool_parsers import PARSERS, ParsedCall, detect, get_parser
from gpu_runtime.rollout.agent.tool_schemas import arguments_text, tool_schema, validate_arguments
from gpu_runtime.rollout.agent.tools import Calculator, ToolNotFound, load_tool
from tests.unit.test_agent_episodes import QWEN, TEMPLATES, qwen_tokenizer, tiny

MISTRAL = (TEMPLATES / "mistral_instruct_v0_3.jinja").read_text()


@dataclass(frozen=True)
class Weather:
    """A tool with structured arguments: it declares its schema and gets them as JSON."""

    name: str = "weather"
    description: str = "the weather in a city"
    schema: ClassVar[dict] = {"type": "object", "properties": {"city": {"type": "string"},
                                                              "unit": {"enum": ["C", "F"]}}, "required": ["city"]}

    def __call__(self, arguments: str) -> str:
        return f"sunny in {json.loads(arguments)['city']}"


def make_weather() -> Weather:
    return Weather()


TOOLS = [tool_schema(Calculator()), tool_schema(Weather())]
CALC = {"expression": "12*34"}
CITY = {"city": "Paris", "unit": "C"}


def ok(name: str, arguments: dict) -> tuple[str, dict, str]:
    return name, arguments, ""


def calls(turn_calls: list[ParsedCall]) -> list[tuple[str, dict | None, str]]:
    return [(c.name, c.arguments, c.error) for c in turn_calls]


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral", "tags"])
def test_a_rendered_call_parses_back(family: str) -> None:
    p = PARSERS[family]
    for name, args in (("calculator", CALC), ("weather", CITY)):
        turn = p.parse(p.render_call(name, args), TOOLS)
        assert calls(turn.calls) == [ok(name, args)] and turn.content == ""
        assert turn.calls[0].raw in p.render_call(name, args)  # mistral: the call's object in its array


def test_hermes() -> None:
    p = get_parser("hermes")
    two = f"Let me compute.\n{p.render_call('calculator', CALC)}\n{p.render_call('weather', CITY)}\nDone."
    turn = p.parse(two, TOOLS)
    assert calls(turn.calls) == [ok("calculator", CALC), ok("weather", CITY)]
    assert turn.content == "Let me compute.\n\n\nDone."
    as_string = '<tool_call>\n{"name": "weather", "arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"C\\"}"}\n</tool_call>'
    assert calls(p.parse(as_string, TOOLS).calls) == [ok("weather", CITY)]
    assert p.parse("The answer is 408.", TOOLS) == p.parse(" The answer is 408. ", TOOLS)
    assert p.parse("The answer is 408.", TOOLS).calls == []
    bad = p.parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": 1+2}}\n</tool_call>', TOOLS).calls
    assert bad[0].name == "calculator" and bad[0].arguments is None and bad[0].error.startswith("malformed JSON")
    unknown = p.parse('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', TOOLS).calls[0]
    assert unknown.name == "search" and "unknown tool 'search'" in unknown.error
    not_object = p.parse('<tool_call>{"name": "calculator", "arguments": ["1+2"]}</tool_call>', TOOLS).calls[0]
    assert not_object.arguments is None and "must be a JSON object" in not_object.error
    # the stop token (or the budget) came inside the second call: the first stands, the second is cut off
    cut = p.parse(p.render_call("calculator", CALC) + '\n<tool_call>\n{"name": "weather", "argu', TOOLS)
    assert calls(cut.calls)[0] == ok("calculator", CALC)
    assert cut.calls[1].name == "weather" and "not closed" in cut.calls[1].error and cut.content == ""


def test_llama3_json() -> None:
    p = get_parser("llama3_json")
    two = f"{p.render_call('calculator', CALC)}; {p.render_call('weather', CITY)}"
    assert calls(p.parse(two, TOOLS).calls) == [ok("calculator", CALC), ok("weather", CITY)]
    tagged = p.parse("Checking.<|python_tag|>" + two, TOOLS)
    assert calls(tagged.calls) == [ok("calculator", CALC), ok("weather", CITY)] and tagged.content == "Checking."
    as_string = '{"name": "weather", "parameters": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"C\\"}"}'
    assert calls(p.parse(as_string, TOOLS).calls) == [ok("weather", CITY)]
    answer = p.parse("The answer is 408.", TOOLS)
    assert answer.calls == [] and answer.content == "The answer is 408."
    unknown = p.parse('{"name": "search", "parameters": {}}', TOOLS).calls[0]
    assert "unknown tool" in unknown.error
    bad = p.parse('<|python_tag|>{"name": "calculator", "parameters": {"expression": 12*34}}', TOOLS).calls[0]
    assert bad.name == "calculator" and bad.arguments is None and bad.error.startswith("malformed JSON")
    cut = p.parse(p.render_call("calculator", CALC) + '; {"name": "weather", "parameters": {"ci', TOOLS).calls
    assert calls(cut)[0] == ok("calculator", CALC) and cut[1].name == "weather" and "cut off" in cut[1].error


def test_mistral() -> None:
    p = get_parser("mistral")
    two = 'Sure. [TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "12*34"}}, ' \
          '{"name": "weather", "arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"C\\"}"}]'
    turn = p.parse(two, TOOLS)
    assert calls(turn.calls) == [ok("calculator", CALC), ok("weather", CITY)] and turn.content == "Sure."
    assert p.parse("The answer is 408.", TOOLS).calls == []
    bad = p.parse('[TOOL_CALLS][{"name": "calculator", "arguments": {expression: "1"}}]', TOOLS).calls[0]
    assert bad.name == "calculator" and bad.error.startswith("malformed JSON")
    unknown = p.parse('[TOOL_CALLS][{"name": "search", "arguments": {}}]', TOOLS).calls[0]
    assert "unknown tool" in unknown.error
    cut = p.parse('[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "12*34"}}, {"name": "wea',
                  TOOLS).calls
    assert calls(cut)[0] == ok("calculator", CALC) and len(cut) == 2 and cut[1].error


def test_tags() -> None:
    """Our tags keep ``parse_tool_call``'s behaviour: the first complete tag of a known tool is the
    call; its body is the tool's single string parameter, or JSON arguments for a tool with several."""
    p = get_parser("tags")
    turn = p.parse("so <calculator> 12*34 </calculator> then <weather>x</weather>", TOOLS)
    assert calls(turn.calls) == [ok("calculator", CALC)] and turn.content == "so  then <weather>x</weather>"
    assert calls(p.parse('<weather>{"city": "Paris", "unit": "C"}</weather>', TOOLS).calls) == [ok("weather", CITY)]
    assert p.parse("<other>1</other> no call", TOOLS).calls == []
    cut = p.parse("<calculator>12*", TOOLS).calls[0]
    assert cut.name == "calculator" and cut.error == "<calculator> is not closed by </calculator>"
    assert p.parse("<weather>{city}</weather>", TOOLS).calls[0].error.startswith("arguments are not valid JSON")


def test_detect_from_the_real_templates() -> None:
    assert detect(QWEN) == "hermes" and detect(MISTRAL) == "mistral"
    assert detect(CHATML_TEMPLATE) == "tags" and detect(None) == "tags" and detect("") == "tags"
    assert detect(tiny()[1].chat_template) == "tags"  # model.init's template: existing runs keep their tokens
    assert detect("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert detect('Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                  'its value}.') == "llama3_json"
    assert get_parser("auto", QWEN).name == "hermes" and get_parser("auto", None).name == "tags"
    with pytest.raises(ValueError, match="tool_parser"):
        get_parser("pythonic")


def test_tool_schemas_and_arguments() -> None:
    calc = tool_schema(Calculator())["function"]
    assert calc["name"] == "calculator" and calc["description"]
    assert calc["parameters"]["properties"] == {"expression": {"type": "string"}}
    assert tool_schema(load_tool("python", 1.0))["function"]["parameters"]["required"] == ["code"]
    upper = tool_schema(load_tool("tests.agent_tools:make_upper", 1.0))["function"]
    assert upper["parameters"]["required"] == ["input"] and "description" not in upper
    weather = tool_schema(Weather())
    assert validate_arguments(weather, CITY) == ""
    assert validate_arguments(weather, {"unit": "C"}) == "invalid arguments: 'city' is a required property"
    assert validate_arguments(weather, {"city": 3}) == "invalid arguments: city: 3 is not of type 'string'"
    assert validate_arguments(weather["function"]["parameters"], {"city": "x", "unit": "K"}).startswith(
        "invalid arguments: unit: 'K' is not one of")
    assert arguments_text(tool_schema(Calculator()), CALC) == "12*34"
    assert arguments_text(weather, {"unit": "C", "city": "Paris"}) == '{"city": "Paris", "unit": "C"}'
    with pytest.raises(ToolNotFound, match="schema"):
        load_tool("tests.unit.test_tool_parsers:bad_schema_tool", 1.0)


@dataclass(frozen=True)
class BadSchema:
    name: str = "bad"
    schema: ClassVar[dict] = {"type": "object", "properties": {"x": {"type": "no-such-type"}}}

    def __call__(self, arguments: str) -> str:
        return arguments


def bad_schema_tool() -> BadSchema:
    return BadSchema()


def test_real_qwen_template_two_calls_incremental_equals_whole_chat() -> None:
    tok = qwen_tokenizer()
    chat = IncrementalChat(tok, "tool", tools=TOOLS)
    messages = [{"role": "user", "content": "What is 12*34, and the weather in Paris?"}]
    prompt = chat.prompt(messages)
    shown = tok.decode(prompt, skip_special=False)
    assert "<tools>" in shown and json.dumps(TOOLS[1]) in shown  # the tools are in the prompt, as Qwen reads them

    parser = get_parser("auto", tok.chat_template)
    written = "\n".join(parser.render_call(n, a) for n, a in (("calculator", CALC), ("weather", CITY)))
    model_ids = [*tok.encode(written), chat.end_of_turn]
    turn = parser.parse(chat.turn_text(model_ids), TOOLS)
    assert parser.name == "hermes" and calls(turn.calls) == [ok("calculator", CALC), ok("weather", CITY)]

    ids = ["call00000", "call00001"]
    tool_calls = [{"id": i, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                  for i, c in zip(ids, turn.calls, strict=True)]
    answers = [{"role": "tool", "content": out, "tool_call_id": i, "name": c.name}
               for out, i, c in zip(("408", "sunny in Paris"), ids, turn.calls, strict=True)]
    incremental = prompt + model_ids + chat.continuation(model_ids, answers, tool_calls=tool_calls)
    whole = [*messages, {"role": "assistant", "content": "", "tool_calls": tool_calls}, *answers]
    want = tok.hf.apply_chat_template(whole, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert tok.decode(incremental, skip_special=False) == want
    assert want.count("<tool_response>") == 2 and want.endswith("<|im_start|>assistant\n")
    assert incremental == tok.encode_chat(whole, tools=TOOLS)  # and token for token


def test_real_mistral_template_calls_parse_back() -> None:
    """What Mistral's template writes for an assistant turn with two calls reads back as those calls."""
    hf = copy.deepcopy(tiny()[1].hf)
    hf.chat_template = MISTRAL
    tool_calls = [{"id": f"call0000{i}", "type": "function", "function": {"name": n, "arguments": a}}
                  for i, (n, a) in enumerate((("calculator", CALC), ("weather", CITY)))]
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": tool_calls}]
    text = hf.apply_chat_template(chat, tools=TOOLS, tokenize=False)
    written = text[text.index("[TOOL_CALLS]"): text.rindex(hf.eos_token)]
    parser = get_parser("auto", MISTRAL)
    assert calls(parser.parse(written, TOOLS).calls) == [ok("calculator", CALC), ok("weather", CITY)]
    one = hf.apply_chat_template(chat[:1] + [{**chat[1], "tool_calls": tool_calls[:1]}], tools=TOOLS, tokenize=False)
    assert parser.render_call("calculator", CALC)[:-2] in one  # the template's call, before its id


def test_a_turns_calls_are_checked_against_the_schemas_before_any_runs() -> None:
    from gpu_runtime.rollout.agent.turn_calls import ParsedCalls

    source = ParsedCalls({"calculator": Calculator(), "weather": Weather()}, get_parser("hermes"), 1.0)
    p = get_parser("hermes")
    text = "".join([p.render_call("calculator", CALC), p.render_call("weather", {"unit": "C"}),
                    p.render_call("search", {}), p.render_call("weather", CITY)])
    good, invalid, unknown, structured = source.calls(text)
    assert (good.tool, good.arguments, good.error) == ("calculator", "12*34", "")
    assert invalid.error == "invalid arguments: 'city' is a required property" and invalid.arguments.startswith("<tool")
    assert "unknown tool 'search'" in unknown.error
    assert structured.arguments == '{"city": "Paris", "unit": "C"}' and source.execute(structured).output == "sunny in Paris"
    assert source.native and source.execute(good).output == "408"
