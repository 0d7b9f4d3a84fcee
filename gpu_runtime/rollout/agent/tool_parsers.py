"""How a model's turn writes its tool calls, read back into calls (docs/agents.md, tool-call formats).

A model trained for tool use writes calls in its family's own format, the one its chat template
teaches it; reading any other format would ask it to unlearn that. The families:

* ``hermes`` (Qwen2.5, Hermes): ``<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>``,
  several per turn, text around them is the turn's content;
* ``llama3_json`` (Llama 3.1 / 3.2 JSON calls): ``{"name": .., "parameters": {..}}``, optionally
  after ``<|python_tag|>``, several separated by ``;``;
* ``mistral``: ``[TOOL_CALLS][{"name": .., "arguments": {..}}, ...]`` after any content;
* ``tags`` (ours, for models we teach ourselves): ``<NAME>ARGS</NAME>``, the first complete tag
  of a known tool; its body is the tool's single string parameter, or JSON arguments.

Parsing is pure and never raises: a call the model got wrong (malformed JSON, an unknown tool,
arguments not an object, a call cut off by the stop token or the token budget) is a
``ParsedCall`` with an ``error``, answered to the model as that tool's error and never executed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gpu_runtime.rollout.agent.tool_schemas import DEFAULT_PARAMETER, schema_named, string_parameter


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict | None  # the call's JSON arguments; None when malformed
    raw: str  # the call's text as the model wrote it
    error: str = ""  # malformed (bad JSON, unknown tool, unclosed): not executed, answered as a tool error


@dataclass(frozen=True)
class ParsedTurn:
    content: str  # the turn's text without its calls (OpenAI message.content), stripped
    calls: list[ParsedCall]  # in the order written; [] = the turn calls nothing


class ToolParser(Protocol):
    name: str

    def parse(self, text: str, tools: Sequence[dict]) -> ParsedTurn:
        """``tools``: OpenAI tool schemas ``[{"type": "function", "function": {"name", "description",
        "parameters"}}]``."""
        ...

    def render_call(self, name: str, arguments: dict) -> str:
        """How this family writes one call (SFT demonstrations, tests)."""
        ...


def tool_names(tools: Sequence[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools if "function" in t]


def _tojson(value: object) -> str:
    """JSON as chat templates' ``tojson`` writes it (transformers: no ASCII escaping, default separators)."""
    return json.dumps(value, ensure_ascii=False)


_NAME = re.compile(r'"name"\s*:\s*"([^"\\]*)"')


def _malformed(raw: str, error: str) -> ParsedCall:
    """A call whose text could not be read: its name when one is visible, for the error answer."""
    found = _NAME.search(raw)
    return ParsedCall(found.group(1) if found else "", None, raw, error)


def _call(raw: str, obj: object, names: Sequence[str], args_keys: tuple[str, ...]) -> ParsedCall:
    """One call from its decoded JSON object ``{"name": .., <args key>: {..} or "{..}"}``."""
    if not isinstance(obj, dict):
        return _malformed(raw, f"a tool call must be a JSON object with a name, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParsedCall("", None, raw, "the tool call has no name")
    args: object = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # arguments as a JSON string (the OpenAI wire shape)
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return ParsedCall(name, None, raw, f"arguments are not valid JSON: {e.msg} (char {e.pos})")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ParsedCall(name, None, raw, f"arguments must be a JSON object, got {type(args).__name__}")
    if name not in names:
        return ParsedCall(name, args, raw, f"unknown tool {name!r} (tools: {', '.join(names) or 'none'})")
    return ParsedCall(name, args, raw)


def _json_values(text: str, pos: int, sep: str, close: str | None) -> tuple[list[tuple[str, object]], int, str]:
    """JSON values written one after another from ``pos``, separated by ``sep``, up to ``close`` when
    given: ``([(raw, value)], end, error)``; ``error`` names what went wrong at ``end`` (then
    ``text[end:]`` is the unread call), "" when the sequence ended well (``text[end:]`` is what follows)."""
    dec = json.JSONDecoder()
    values: list[tuple[str, object]] = []
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if close is not None and text.startswith(close, pos):
            return values, pos + len(close), ""
        if pos >= len(text):
            return values, pos, f"the calls are not closed by {close!r} (cut off?)" if close else ""
        try:
            value, end = dec.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            cut = e.pos >= len(text) or e.msg.startswith("Unterminated string")
            return values, pos, f"malformed JSON: {e.msg}{' (cut off?)' if cut else ''}"
        values.append((text[pos:end], value))
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if text.startswith(sep, pos):
            pos += len(sep)
        elif close is None and not text.startswith("{", pos):
            return values, pos, ""  # the text after the calls
        elif close is not None and not text.startswith(close, pos):
            return values, pos, f"expected {sep!r} or {close!r} between calls" if pos < len(text) else (
                f"the calls are not closed by {close!r} (cut off?)")


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (Qwen2.5 / Hermes chat templates)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def parse(self, text: str, tools: Sequence[dict]) -> ParsedTurn:
        names = tool_names(tools)
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while (start := text.find(self.OPEN, pos)) >= 0:
            content.append(text[pos:start])
            body_at = start + len(self.OPEN)
            end = text.find(self.CLOSE, body_at)
            if end < 0:  # the stop token or the budget came first
                calls.append(_malformed(text[start:], f"{self.OPEN} is not closed by {self.CLOSE} (cut off?)"))
                pos = len(text)
                break
            raw, pos = text[start:end + len(self.CLOSE)], end + len(self.CLOSE)
            try:
                obj = json.loads(text[body_at:end])
            except json.JSONDecodeError as e:
                calls.append(_malformed(raw, f"malformed JSON: {e.msg} (char {e.pos})"))
                continue
            calls.append(_call(raw, obj, names, ("arguments", "parameters")))
        content.append(text[pos:])
        return ParsedTurn("".join(content).strip(), calls)

    def render_call(self, name: str, arguments: dict) -> str:
        return f'{self.OPEN}\n{{"name": "{name}", "arguments": {_tojson(arguments)}}}\n{self.CLOSE}'


class Llama3JsonParser:
    """Llama 3.1 / 3.2 JSON calls: the turn is ``{"name": .., "parameters": {..}}`` (``;``-separated
    when several), optionally after ``<|python_tag|>``; a turn that starts with no call is an answer."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, tools: Sequence[dict]) -> ParsedTurn:
        head, tag, rest = text.partition(self.PYTHON_TAG)
        if tag:
            content, body = head, rest
        elif text.lstrip().startswith("{") and _NAME.search(text):
            content, body = "", text
        else:
            return ParsedTurn(text.strip(), [])
        names = tool_names(tools)
        values, end, error = _json_values(body, 0, ";", None)
        calls = [_call(raw, obj, names, ("parameters", "arguments")) for raw, obj in values]
        if error:
            calls.append(_malformed(body[end:].strip(), error))
            end = len(body)
        return ParsedTurn((content + body[end:]).strip(), calls)

    def render_call(self, name: str, arguments: dict) -> str:
        return f'{{"name": "{name}", "parameters": {_tojson(arguments)}}}'


class MistralParser:
    """``[TOOL_CALLS]`` then a JSON array of ``{"name": .., "arguments": {..}}`` (Mistral templates)."""

    name = "mistral"
    MARK = "[TOOL_CALLS]"

    def parse(self, text: str, tools: Sequence[dict]) -> ParsedTurn:
        head, mark, rest = text.partition(self.MARK)
        if not mark:
            return ParsedTurn(text.strip(), [])
        names = tool_names(tools)
        body = rest.lstrip()
        if not body.startswith("["):  # one object without its array
            values, end, error = _json_values(body, 0, ",", None)
        else:
            values, end, error = _json_values(body, 1, ",", "]")
        calls = [_call(raw, obj, names, ("arguments", "parameters")) for raw, obj in values]
        if error and body[end:].strip():  # a call cut off or garbled (an array cut off after a call: those count)
            calls.append(_malformed(body[end:].strip(), error))
        if error:
            end = len(body)
        return ParsedTurn((head + body[end:]).strip(), calls)

    def render_call(self, name: str, arguments: dict) -> str:
        return f'{self.MARK}[{{"name": "{name}", "arguments": {_tojson(arguments)}}}]'


@dataclass(frozen=True)
class Tag:
    """The first ``<name>`` of a known tool in a text: where it starts, its body (stripped), where the
    call ends, and whether ``</name>`` closed it."""

    name: str
    start: int
    end: int
    body: str
    closed: bool


def first_tag(text: str, names: Sequence[str]) -> Tag | None:
    if not names:
        return None
    alt = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    opened = re.search(rf"<({alt})>", text)
    if opened is None:
        return None
    name = opened.group(1)
    close = text.find(f"</{name}>", opened.end())
    if close < 0:
        return Tag(name, opened.start(), len(text), text[opened.end():].strip(), closed=False)
    return Tag(name, opened.start(), close + len(name) + 3, text[opened.end():close].strip(), closed=True)


class TagsParser:
    """Our ``<NAME>ARGS</NAME>``: one call per turn, the first complete tag of a known tool. The body
    is the tool's single required string parameter when its schema has one, else JSON arguments."""

    name = "tags"

    def parse(self, text: str, tools: Sequence[dict]) -> ParsedTurn:
        tag = first_tag(text, tool_names(tools))
        if tag is None:
            return ParsedTurn(text.strip(), [])
        content = (text[:tag.start] + text[tag.end:]).strip()
        raw = text[tag.start:tag.end]
        if not tag.closed:
            return ParsedTurn(content, [ParsedCall(tag.name, None, raw, f"<{tag.name}> is not closed by </{tag.name}>")])
        schema = schema_named(tools, tag.name)
        key = string_parameter(schema) if schema is not None else DEFAULT_PARAMETER
        if key is not None:
            return ParsedTurn(content, [ParsedCall(tag.name, {key: tag.body}, raw)])
        try:
            obj = json.loads(tag.body) if tag.body else {}
        except json.JSONDecodeError as e:
            return ParsedTurn(content, [ParsedCall(tag.name, None, raw, f"arguments are not valid JSON: {e.msg}")])
        return ParsedTurn(content, [_call(raw, {"name": tag.name, "arguments": obj}, [tag.name], ("arguments",))])

    def render_call(self, name: str, arguments: dict) -> str:
        values = list(arguments.values())
        body = values[0] if len(values) == 1 and isinstance(values[0], str) else _tojson(arguments)
        return f"<{name}>{body}</{name}>"


PARSERS: dict[str, ToolParser] = {
    p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser(), TagsParser())
}
# what a template writes when it teaches a family's calls (Llama 3.1's JSON-call instruction wording)
_LLAMA3_WORDING = ("respond with a JSON for a function call", '"parameters": dictionary of argument name')


def detect(chat_template: str | None) -> str:
    """The family a chat template teaches, from what its text writes: ``<tool_call>`` → hermes,
    ``[TOOL_CALLS]`` → mistral, ``<|python_tag|>`` or Llama 3.1's JSON-call wording → llama3_json;
    anything else (no template, plain ChatML such as ``model.init``'s) → tags."""
    t = chat_template or ""
    if HermesParser.OPEN in t:
        return "hermes"
    if MistralParser.MARK in t:
        return "mistral"
    if Llama3JsonParser.PYTHON_TAG in t or any(w in t for w in _LLAMA3_WORDING):
        return "llama3_json"
    return "tags"


def get_parser(name: str, chat_template: str | None = None) -> ToolParser:
    """The parser ``name`` (``agent.tool_parser``); ``auto``: the one ``detect(chat_template)`` names."""
    if name == "auto":
        name = detect(chat_template)
    if name not in PARSERS:
        raise ValueError(f"tool_parser must be auto or one of {', '.join(PARSERS)}, got {name!r}")
    return PARSERS[name]
