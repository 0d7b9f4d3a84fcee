# TEMPORARY STUB (not committed): replaced by the parsers branch
from __future__ import annotations
import json
import re
from dataclasses import dataclass
from typing import Protocol
from collections.abc import Sequence

@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: dict | None
    raw: str
    error: str = ""

@dataclass(frozen=True)
class ParsedTurn:
    content: str
    calls: list[ParsedCall]

class ToolParser(Protocol):
    name: str
    def parse(self, text: str, tools: Sequence[dict]) -> ParsedTurn: ...

class Tags:
    name = "tags"
    def parse(self, text: str, tools: Sequence[dict]) -> ParsedTurn:
        names = [t["function"]["name"] for t in tools]
        for n in names:
            m = re.search(rf"<{n}>(.*?)</{n}>", text, re.S)
            if m:
                props = tools[names.index(n)]["function"].get("parameters", {}).get("required", ["input"])
                return ParsedTurn(text[:m.start()].strip(), [ParsedCall(n, {props[0]: m.group(1).strip()}, m.group(0))])
        return ParsedTurn(text.strip(), [])

class Hermes:
    name = "hermes"
    def parse(self, text: str, tools: Sequence[dict]) -> ParsedTurn:
        calls = []
        for m in re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.S):
            try:
                d = json.loads(m.group(1))
                calls.append(ParsedCall(d["name"], d["arguments"], m.group(0)))
            except Exception as e:
                calls.append(ParsedCall("", None, m.group(0), str(e)))
        return ParsedTurn(re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S).strip(), calls)

def detect(t: str | None) -> str:
    return "hermes" if t and "<tool_call>" in t else "tags"

def get_parser(name: str, chat_template: str | None = None) -> ToolParser:
    name = detect(chat_template) if name == "auto" else name
    return Hermes() if name == "hermes" else Tags()
