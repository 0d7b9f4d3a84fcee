"""Your agent's code for one episode, in a child process of the node agent
(``agent_child``), ended on our terms.

One process per episode: an agent that crashes, leaks, or hangs is killed (its whole process
group, by pid) without touching the node agent or the chunk's other episodes, and its
wall-clock budget is its own. The cost is an interpreter start and your module's imports per
episode (measured in bench/bench_agent_endpoint.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STDERR_TAIL = 2000


@dataclass(frozen=True)
class AgentExit:
    status: str  # completed | agent_error (raised, or exited without a result) | timeout | killed (a signal from outside) | stopped
    answer: str | None = None
    error: str = ""
    pid: int = 0
    seconds: float = 0.0


def run_agent(
    entrypoint: str, base_url: str, api_key: str, row: dict, *, timeout_s: float,
    on_start: Callable[[int], None] = lambda _pid: None, should_stop: Callable[[], bool] = lambda: False,
    poll_s: float = 0.05,
) -> AgentExit:
    """``entrypoint(base_url, api_key, row)`` in a child process; its end within ``timeout_s``."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="milestone-agent-") as tmp:
        result, log_path = Path(tmp) / "result.json", Path(tmp) / "output.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gpu_runtime.rollout.agent.agent_child", str(result)],
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
        on_start(proc.pid)
        job = {"entrypoint": entrypoint, "base_url": base_url, "api_key": api_key, "row": row,
               "parent_pid": os.getpid()}
        try:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(job).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: its exit says how
        ended_by_us = ""
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                ended_by_us = "timeout"
            elif should_stop():
                ended_by_us = "stopped"
            if ended_by_us:
                break
            time.sleep(poll_s)
        _kill_group(proc.pid)  # the agent's own children too (its group), whether it ended or not
        proc.wait()
        seconds = time.monotonic() - t0
        if ended_by_us == "timeout":
            return AgentExit("timeout", error=f"the agent ran past agent.episode_timeout_s ({timeout_s:g} s)",
                             pid=proc.pid, seconds=seconds)
        if ended_by_us:
            return AgentExit("stopped", error="stopped: the rollout failed", pid=proc.pid, seconds=seconds)
        if result.exists():
            body = json.loads(result.read_text())
            if body["ok"]:
                return AgentExit("completed", answer=body["answer"], pid=proc.pid, seconds=seconds)
            return AgentExit("agent_error", error=body["error"], pid=proc.pid, seconds=seconds)
        tail = log_path.read_bytes()[-STDERR_TAIL:].decode(errors="replace")
        if proc.returncode < 0:
            return AgentExit("killed", error=f"killed by {signal.Signals(-proc.returncode).name}", pid=proc.pid,
                             seconds=seconds)
        return AgentExit("agent_error", error=f"exited with code {proc.returncode} before returning: {tail}",
                         pid=proc.pid, seconds=seconds)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
