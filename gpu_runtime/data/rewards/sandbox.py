"""Reward functions run in a child process that can be killed.

A custom reward function (or math-verify) may hang: an infinite loop, a stuck
network call, sympy on odd input. A thread cannot be stopped, so the scorer runs
such functions in a child process (``RewardSandbox``), one call at a time, and
SIGKILLs the child's process group when a call outlives its timeout; the next call
starts a fresh child. The child imports functions by dotted path, with the
parent's ``sys.path`` in front of its own, and talks JSON lines on a private
pipe (the function's own prints go to stderr).
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import time
from types import TracebackType

from gpu_runtime.data.rewards.errors import RewardFunctionNotFound
from gpu_runtime.proc.processes import exit_when_parent_dies, stop_pid

log = logging.getLogger(__name__)

_BOOT = (
    "import json, sys; sys.path[:0] = [p for p in json.loads(sys.argv[1]) if p not in sys.path]; "
    "from gpu_runtime.data.rewards.sandbox import serve; serve()"
)


class CallTimeout(RuntimeError):
    """The call outlived its timeout; the child was killed."""


class CallFailed(RuntimeError):
    """The function raised, returned something other than a finite number, or its process died."""


LOAD_TIMEOUT_S = 300.0  # importing a function's module (it may import torch) is not the call


class RewardSandbox:
    """One child process for a scoring pass: ``call(path, args, timeout_s)`` at a time.
    Use as a context manager: the child is stopped (by pid) when the block ends."""

    def __init__(self, load_timeout_s: float = LOAD_TIMEOUT_S) -> None:
        self.proc: subprocess.Popen | None = None
        self._buf = b""
        self._loaded: set[str] = set()  # functions the current child has imported
        self.load_timeout_s = load_timeout_s
        self.kills = 0  # children killed for a timeout

    def __enter__(self) -> RewardSandbox:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.close()  # the child exits at EOF
                proc.wait(timeout=2.0)
            except (OSError, subprocess.TimeoutExpired):
                stop_pid(proc.pid, proc, timeout_s=2.0)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()

    def call(self, path: str, args: list, timeout_s: float) -> float:
        """``path(*args)`` in the child; its result as a float. ``RewardFunctionNotFound``
        when ``path`` does not load, ``CallTimeout`` after ``timeout_s`` (the child is
        killed), ``CallFailed`` for an exception, a bad result or a dead child. Loading
        the function (importing its module) has its own, longer timeout."""
        self._started()
        if path not in self._loaded:
            self._request({"path": path, "load": True}, self.load_timeout_s, "loading it")
            self._loaded.add(path)
        reply = self._request({"path": path, "args": args}, timeout_s, "the call")
        if "error" in reply:
            raise CallFailed(f"raised {reply['error']}")
        value = reply["ok"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CallFailed(f"returned {reply.get('type', type(value).__name__)}, expected float")
        if not math.isfinite(value):
            raise CallFailed(f"returned non-finite value {value!r}")
        return float(value)

    def _request(self, req: dict, timeout_s: float, what: str) -> dict:
        proc = self._started()
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(req).encode() + b"\n")
            proc.stdin.flush()
        except BrokenPipeError:
            code = proc.poll()
            self._discard()
            raise CallFailed(f"the reward process exited (code {code}) before {what}") from None
        try:
            line = self._read_line(proc, timeout_s)
        except EOFError:
            code = proc.wait()
            self._discard()
            raise CallFailed(f"the reward process died during {what} (exit code {code})") from None
        if line is None:
            self.kills += 1
            self._discard()
            doing = "" if what == "the call" else f" {what}"
            raise CallTimeout(f"timed out{doing} after {timeout_s:g} s (its process was killed)")
        reply = json.loads(line)
        if "not_found" in reply:
            raise RewardFunctionNotFound(reply["not_found"])
        return reply

    def _started(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self._discard()
            paths = [os.getcwd() if p == "" else p for p in sys.path]
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, json.dumps(paths)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
            )
            self._buf = b""
            self._loaded = set()
        return self.proc

    def _discard(self) -> None:
        """Kill the child (its whole process group: whatever the function started too)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10.0)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None and not pipe.closed:
                    pipe.close()
        self._buf = b""

    def _read_line(self, proc: subprocess.Popen, timeout_s: float) -> bytes | None:
        """The child's next reply line; None on timeout, EOFError when it exited."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line


# ---- the child ---------------------------------------------------------------------------
def serve() -> None:
    """The child's loop: one JSON request per stdin line, one reply per line on the
    private pipe, until stdin closes (or the parent dies)."""
    from gpu_runtime.data.rewards.loader import load_reward_function

    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # the functions' own prints go to stderr, never into the replies
    sys.stdout = sys.stderr
    exit_when_parent_dies(os.getppid())
    functions: dict = {}
    for line in sys.stdin:
        req = json.loads(line)
        out.write(json.dumps(_answer(req, functions, load_reward_function)) + "\n")


def _answer(req: dict, functions: dict, load) -> dict:  # noqa: ANN001 - the loader, passed in
    path = req["path"]
    try:
        fn = functions.get(path) or functions.setdefault(path, load(path))
    except RewardFunctionNotFound as err:
        return {"not_found": str(err)}
    if req.get("load"):
        return {"loaded": True}
    try:
        value = fn(*req["args"])
    except BaseException as err:  # noqa: BLE001 - reported to the parent
        return {"error": f"{type(err).__name__}: {err}"}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return {"ok": None, "type": type(value).__name__}
    return {"ok": float(value)}  # NaN / inf travel as JSON extensions; the parent refuses them
