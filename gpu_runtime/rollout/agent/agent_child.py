"""The processes that run your agent code (``rollout.agent.kind: openai``).

``python -m gpu_runtime.rollout.agent.agent_child ENTRYPOINT PARENT_PID`` is a chunk's *zygote*:
it imports ``ENTRYPOINT`` (``pkg.module:run``) once, then reads one JSON job per line on stdin
(``episode``, ``base_url``, ``api_key``, ``row``, ``result``, ``log``) and forks one process per
job. Each forked episode process starts its own session (its own process group: the node
agent kills it, and whatever it started, by its pid), sends its output to ``log``, calls
``run(base_url, api_key, row)`` (a coroutine function is run with ``asyncio.run``), writes
``{"ok": true, "answer": ...}`` or ``{"ok": false, "error": ...}`` to ``result`` and exits.
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` are set too, so a client built with no arguments
reaches the episode's endpoint.

The zygote reports on stdout, one JSON line each: ``{"episode", "pid"}`` when it forked, and
``{"episode", "exit"}`` (the exit code, or minus the signal) when that process ended. A module
that fails to import is reported once (``{"import_error": ...}``), and every episode then ends
as ``agent_error`` naming it. Zygote and episode processes exit when the node agent is gone.

Forking from a process that has imported your module costs milliseconds an episode, where a
fresh interpreter costs the interpreter and your imports (``openai`` alone is ~0.6 s of CPU).
When your module imported ``openai``, the zygote also makes one call through it against a
canned local answer first (``warm_openai``): the SDK's first call loads and builds what every
later one reuses, so each forked episode starts warm.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import select
import sys
import traceback
from collections.abc import Callable
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


# a canned chat.completion with a tool call: what the zygote's warm-up call gets back
_WARM_REPLY = json.dumps({
    "id": "chatcmpl-warmup", "object": "chat.completion", "created": 0, "model": "policy",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "warmup000", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}).encode()


def warm_openai() -> None:
    """One chat completion through the ``openai`` SDK against a canned local answer, in the
    zygote, when the entrypoint imported it: the SDK loads its resources and builds its models
    on first use (~0.5 s of CPU, measured), which every forked episode would otherwise pay again.
    The stub server is shut down and joined before any fork."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import openai

    class Canned(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(_WARM_REPLY)))
            self.end_headers()
            self.wfile.write(_WARM_REPLY)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Canned)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="warm-up",
                           max_retries=0) as client:
            reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
            reply.choices[0].message.model_dump(exclude_none=True)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _say(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _episode(run: Callable[..., Any], job: dict, parent_pid: int) -> None:
    """In the forked process: run the episode, write its result, never return."""
    code = 0
    try:
        os.setsid()
        fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        from gpu_runtime.proc.processes import exit_when_parent_dies

        exit_when_parent_dies(parent_pid)
        os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"] = job["base_url"], job["api_key"]
        try:
            out = run(job["base_url"], job["api_key"], job["row"])
            if inspect.isawaitable(out):
                out = asyncio.run(_awaited(out))
            result = {"ok": True, "answer": answer_text(out)}
        except BaseException as e:  # noqa: BLE001 - the agent's failure is the episode's outcome
            tb = traceback.format_exception(type(e), e, e.__traceback__)
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": "".join(tb)[-4000:]}
        with open(job["result"] + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(job["result"] + ".tmp", job["result"])
    except BaseException:  # noqa: BLE001 - nothing may escape into the zygote's loop
        code = 70
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


async def _awaited(aw: Any) -> Any:
    return await aw


def main() -> int:
    entrypoint, parent_pid = sys.argv[1], int(sys.argv[2])
    from gpu_runtime.proc.processes import exit_when_parent_dies

    exit_when_parent_dies(parent_pid)
    run: Callable[..., Any] | None = None
    try:
        mod_name, _, attr = entrypoint.partition(":") if ":" in entrypoint else entrypoint.rpartition(".")
        run = getattr(importlib.import_module(mod_name), attr)
    except BaseException as e:  # noqa: BLE001 - reported; every episode then ends naming it
        _say({"import_error": f"rollout.agent.entrypoint {entrypoint!r}: {type(e).__name__}: {e}"})
    if run is not None and "openai" in sys.modules:
        try:
            warm_openai()
        except Exception:  # noqa: BLE001 - only a warm-up: each episode then pays the SDK's first use itself
            pass
    running: dict[int, int] = {}  # pid -> episode
    stdin = sys.stdin.buffer
    buf = b""
    open_ = True
    while open_ or running:
        ready, _, _ = select.select([stdin] if open_ else [], [], [], 0.02)
        if ready:
            chunk = os.read(stdin.fileno(), 1 << 16)
            if not chunk:
                open_ = False  # the node agent closed the chunk: finish reporting, then exit
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                job = json.loads(line)
                if run is None:
                    continue
                pid = os.fork()
                if pid == 0:
                    _episode(run, job, parent_pid)
                running[pid] = job["episode"]
                _say({"episode": job["episode"], "pid": pid})
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            episode = running.pop(pid, None)
            if episode is not None:
                code = os.waitstatus_to_exitcode(status)
                _say({"episode": episode, "exit": code})
    return 0


if __name__ == "__main__":
    sys.exit(main())
