"""Agent programs for the OpenAI-kind tests (``rollout.agent.entrypoint``): each is a ``run(base_url,
api_key, row)`` that a child process of the rollout calls, as a user's agent is. Written with the
real ``openai`` SDK; the well-behaved one is ``examples/agents/react_calculator.py`` itself."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from openai import OpenAI

from examples.agents.react_calculator import CALCULATOR, calculator


def _client(base_url: str, api_key: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def _react_interrupted(base_url: str, api_key: str, row: dict[str, Any], after_first_reply: Any) -> str:
    """The ReAct example's loop (the same requests), calling ``after_first_reply()`` once its first
    call has been answered."""
    client = _client(base_url, api_key)
    messages: list[dict[str, Any]] = list(row["messages"])
    for turn in range(4):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        if turn == 0:
            after_first_reply()
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            arguments = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculator(str(arguments.get("expression", "")))})
    return ""


def dies_once(base_url: str, api_key: str, row: dict[str, Any]) -> str:
    """The ReAct agent, but the first time it runs for a row it SIGKILLs itself right after its
    first call was answered (as the OOM killer would): the rollout restarts it and that call is
    replayed. ``MILESTONE_TEST_MARKS`` is the folder that remembers."""
    mark = Path(os.environ["MILESTONE_TEST_MARKS"]) / f"{row['id']}.died"

    def die() -> None:
        if not mark.exists():
            mark.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)

    return _react_interrupted(base_url, api_key, row, die)


def kills_its_zygote_once(base_url: str, api_key: str, row: dict[str, Any]) -> str:
    """The ReAct agent, but the first episode to get past its first call SIGKILLs the chunk's
    zygote (the process that forked it) and hangs: every episode of the chunk loses its process's
    end, is killed, and restarts from a new zygote, replaying its recorded calls."""
    mark = Path(os.environ["MILESTONE_TEST_MARKS"]) / "zygote.killed"

    def kill_zygote() -> None:
        try:
            fd = os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(3600)  # killed with its group once its zygote's end is seen

    return _react_interrupted(base_url, api_key, row, kill_zygote)


def raises(base_url: str, api_key: str, row: dict[str, Any]) -> str:
    _client(base_url, api_key).chat.completions.create(model="policy", messages=list(row["messages"]), max_tokens=4)
    raise RuntimeError("the agent's own bug")


def hangs(base_url: str, api_key: str, row: dict[str, Any]) -> str:
    time.sleep(3600)
    return ""


def never_calls(base_url: str, api_key: str, row: dict[str, Any]) -> str:
    return "42"


def edits_history(base_url: str, api_key: str, row: dict[str, Any]) -> str:
    """Asks once, then asks again with a rewritten conversation (the first reply dropped): the
    second call does not extend the first, so it starts the episode's trained segment afresh."""
    client = _client(base_url, api_key)
    client.chat.completions.create(model="policy", messages=list(row["messages"]), tools=[CALCULATOR], max_tokens=8)
    question = row["messages"][-1]["content"]
    messages = [{"role": "user", "content": f"Answer with the number only. {question}"}]
    reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR], max_tokens=8)
    return reply.choices[0].message.content or ""

