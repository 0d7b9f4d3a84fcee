"""The OpenAI chat-completions contract of the agent endpoint: what a request may ask for,
the error body a request gets when it asks for something the endpoint cannot serve, and the
response built from a model call.

Pure (no I/O, no torch). ``read_request`` turns a JSON body into a ``ChatRequest`` or raises
``RequestError`` naming the field (``param``) the way OpenAI's API does, so any OpenAI client
shows the message. ``ChatRequest.digest`` is what a replayed call is matched on: the messages,
the tools and every parameter that shapes the completion, canonicalised (key order, a tool
call's arguments as parsed JSON), so two clients that serialise the same request differently
still match.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

MODEL = "policy"  # the served model's name (GET /v1/models); the run's current policy version
ROLES = ("system", "developer", "user", "assistant", "tool")
# accepted and ignored: they do not change what is generated here (seed: every call's seed is the run's own)
IGNORED = ("user", "metadata", "store", "seed", "parallel_tool_calls", "stream_options", "service_name")


class RequestError(ValueError):
    """A request the endpoint cannot serve: HTTP ``status`` with an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, Any]]  # normalised: text content, tool calls' arguments as parsed JSON
    tools: list[dict[str, Any]]  # OpenAI function schemas ([] : none)
    tool_choice: str  # auto | none
    max_tokens: int | None
    stop: list[str]
    logprobs: bool
    top_logprobs: int

    @property
    def digest(self) -> str:
        canon = json.dumps(
            {"messages": self.messages, "tools": self.tools, "tool_choice": self.tool_choice,
             "max_tokens": self.max_tokens, "stop": self.stop, "logprobs": self.logprobs,
             "top_logprobs": self.top_logprobs},
            sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canon.encode()).hexdigest()

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template renders them (none when ``tool_choice`` is none)."""
        return self.tools if self.tools and self.tool_choice != "none" else None


def read_request(body: Any, *, temperature: float, top_p: float) -> ChatRequest:
    """``body`` checked against what this endpoint serves. ``temperature`` / ``top_p``: the run's
    sampling (``rollout.temperature`` / ``top_p``): the trainer's logprobs assume them, so a
    request may repeat them but not change them."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    known = {"model", "messages", "tools", "tool_choice", "n", "temperature", "top_p", "max_tokens",
             "max_completion_tokens", "stop", "stream", "logprobs", "top_logprobs", "frequency_penalty",
             "presence_penalty", "response_format", "logit_bias", *IGNORED}
    for key in body:
        if key not in known:
            raise RequestError(f"unrecognized request argument supplied: {key}", key)
    if body.get("model") != MODEL:
        raise RequestError(f"the model {body.get('model')!r} does not exist: this endpoint serves {MODEL!r}",
                           "model", status=404, code="model_not_found")
    if body.get("stream"):
        raise RequestError("stream is not supported by this endpoint: call without stream", "stream")
    if body.get("n", 1) != 1:
        raise RequestError(f"n must be 1 (one completion per call), got {body.get('n')!r}", "n")
    _same(body, "temperature", temperature)
    _same(body, "top_p", top_p)
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise RequestError(f"{key} is not supported: the trainer's logprobs assume plain sampling", key)
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported: the trainer's logprobs assume plain sampling", "logit_bias")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise RequestError("response_format other than text is not supported", "response_format")
    messages = _messages(body.get("messages"))
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice", "auto")
    if choice is None:
        choice = "auto"
    if choice not in ("auto", "none"):
        raise RequestError(f"tool_choice {choice!r} is not supported: auto or none (no constrained decoding here)",
                           "tool_choice")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise RequestError(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise RequestError("stop must be a string or a list of up to 4 non-empty strings", "stop")
    top = body.get("top_logprobs") or 0
    if top:
        raise RequestError("top_logprobs is not supported (logprobs: true gives each chosen token's)", "top_logprobs")
    return ChatRequest(messages, tools, choice, max_tokens, list(stop), bool(body.get("logprobs")), 0)


def _same(body: dict, key: str, run_value: float) -> None:
    got = body.get(key)
    if got is not None and abs(float(got) - run_value) > 1e-9:
        raise RequestError(
            f"{key} {got} differs from the run's rollout.{key} {run_value:g}: the trainer's logprobs assume the "
            f"run's sampling; omit {key} or pass {run_value:g}", key)


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RequestError(f"{where}[{j}]: content of type {kind!r} is not supported (text only)",
                                   f"{where}[{j}]")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where} must be a string or a list of text parts", where)


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"{where}.role must be one of {', '.join(ROLES)}", f"{where}.role")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{where}.content") or ""}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])]
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise RequestError(f"{where}.tool_call_id is required for role tool", f"{where}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"{where}.function.name is required", f"{where}.function")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # kept as written: the template shows it as a string
    return {"id": str(c.get("id", "")), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _tools(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise RequestError("tools must be a list of function tools", "tools")
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise RequestError(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}", f"tools[{i}]")
    return raw


def call_id(seed: str, index: int) -> str:
    """A tool call's id: 9 letters and digits (what the strictest templates, Mistral's, accept),
    a pure function of the call's position so a replayed answer carries the same ids."""
    digest = int(hashlib.sha256(f"{seed}/{index}".encode()).hexdigest(), 16)
    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    out = ""
    for _ in range(9):
        digest, r = divmod(digest, len(alphabet))
        out += alphabet[r]
    return out


def completion_body(
    *, completion_id: str, created: int, content: str, tool_calls: list[dict[str, Any]], finish_reason: str,
    prompt_tokens: int, completion_tokens: int, token_logprobs: list[tuple[str, float]] | None,
) -> dict[str, Any]:
    """The ``chat.completion`` object (OpenAI's shape): one choice, its message, usage."""
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not tool_calls else None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    logprobs = None
    if token_logprobs is not None:
        logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in token_logprobs]}
    return {
        "id": completion_id, "object": "chat.completion", "created": created, "model": MODEL,
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": logprobs}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def openai_tool_call(cid: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def returned_message(response: dict[str, Any]) -> dict[str, Any]:
    """The assistant message a response returned, normalised as a request's messages are (what
    the agent's next request carries back when it extends the conversation)."""
    m = response["choices"][0]["message"]
    msg: dict[str, Any] = {"role": "assistant", "content": m.get("content") or ""}
    if m.get("tool_calls"):
        msg["tool_calls"] = [_call(c, "tool_calls") for c in m["tool_calls"]]
    return msg


def same_message(sent: dict[str, Any], returned: dict[str, Any]) -> bool:
    """``sent`` (from a request) is the assistant message the endpoint returned: the same text
    and the same calls (names and arguments; an agent may drop or keep ids and ``name``)."""
    if sent.get("role") != "assistant" or (sent.get("content") or "").strip() != (returned.get("content") or "").strip():
        return False
    a, b = sent.get("tool_calls") or [], returned.get("tool_calls") or []
    return len(a) == len(b) and all(
        x["function"]["name"] == y["function"]["name"] and x["function"]["arguments"] == y["function"]["arguments"]
        for x, y in zip(a, b))
