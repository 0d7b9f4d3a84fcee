"""The child process that runs one episode of your agent code: ``python -m
gpu_runtime.rollout.agent.agent_child RESULT_FILE`` with a JSON job on stdin
(``entrypoint``, ``base_url``, ``api_key``, ``row``).

It imports ``entrypoint`` (``pkg.module:run``), calls ``run(base_url, api_key, row)`` (a
coroutine function is run with ``asyncio.run``) and writes ``{"ok": true, "answer": ...}`` or
``{"ok": false, "error": ...}`` to RESULT_FILE. ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` are
set too, so a client built with no arguments reaches the episode's endpoint. It exits when the
node agent that started it is gone.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import sys
import traceback
from typing import Any


def answer_text(value: Any) -> str | None:
    """What ``run`` returned, as the text the reward scores: a string as is, a mapping's
    ``answer``, ``None`` for nothing (the reward then scores the model's last reply)."""
    if value is None:
        return None
    if isinstance(value, dict):
        inner = value.get("answer")
        return None if inner is None else str(inner)
    return str(value)


def main() -> int:
    result_file = sys.argv[1]
    job = json.loads(sys.stdin.read())
    from gpu_runtime.proc.processes import exit_when_parent_dies

    exit_when_parent_dies(int(job["parent_pid"]))
    os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"] = job["base_url"], job["api_key"]
    try:
        mod_name, _, attr = job["entrypoint"].partition(":")
        run = getattr(importlib.import_module(mod_name), attr)
        out = run(job["base_url"], job["api_key"], job["row"])
        if inspect.isawaitable(out):
            out = asyncio.run(_awaited(out))
        result = {"ok": True, "answer": answer_text(out)}
    except BaseException as e:  # noqa: BLE001 - the agent's failure is the episode's outcome
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": "".join(tb)[-4000:]}
    with open(result_file + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(result_file + ".tmp", result_file)
    return 0


async def _awaited(aw: Any) -> Any:
    return await aw


if __name__ == "__main__":
    sys.exit(main())
