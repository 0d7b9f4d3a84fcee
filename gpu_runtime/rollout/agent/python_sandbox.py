"""The ``python`` tool: the model's code run in a fresh, limited child process.

Each call gets a new temporary working directory (deleted afterwards) and a child
``python -I`` in its own session, with:

* CPU time capped by ``RLIMIT_CPU`` and memory (address space) by ``RLIMIT_AS``, both
  set hard in the child before the code runs, so the code cannot raise them;
* a wall-clock timeout: past it the child's process group is SIGKILLed (by its pid);
* no network: the child runs inside a new network namespace (``unshare --net``, with
  ``--map-root-user`` when not root) wherever the kernel allows it — only a loopback
  that is down exists there. Whether or not that works, an audit hook installed before
  the code runs refuses to create sockets and to start processes (``subprocess``,
  ``os.system``, ``fork``, ``exec*``) or load C libraries by ``ctypes``. The hook alone is a
  guard for honest mistakes, not a security boundary (see docs/agents.md).

What the model sees is the child's stdout (its last ``max_output_chars``), and on a
failure the tail of its stderr.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import ClassVar

from gpu_runtime.proc.processes import signal_group
from gpu_runtime.rollout.agent.tool_api import ToolResult
from gpu_runtime.rollout.agent.tool_schemas import default_parameters

# runs in the child before the model's code: limits first, then the audit hook
_PRELUDE = """\
import resource, sys
_cpu, _mem = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu))
resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
_DENY = ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "subprocess.Popen",
         "os.system", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "pty.spawn", "ctypes.dlopen")
def _hook(event, args):
    if event in _DENY:
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_hook)
del resource, _hook
_code = open("main.py", encoding="utf-8").read()
exec(compile(_code, "main.py", "exec"), {"__name__": "__main__"})
"""


@functools.cache
def net_isolation_prefix() -> tuple[str, ...]:
    """The command prefix that puts a child into a new network namespace here, or ``()``
    when this machine does not allow it (no ``unshare``, user namespaces off)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    candidates: list[tuple[str, ...]] = [(unshare, "--net")] if os.geteuid() == 0 else []
    candidates.append((unshare, "--net", "--map-root-user"))
    for prefix in candidates:
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            continue
    return ()


@dataclass(frozen=True)
class PythonSandbox:
    """The ``python`` tool. ``timeout_s``: wall clock; ``cpu_s``: CPU seconds;
    ``memory_mb``: address-space limit of the child."""

    timeout_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_output_chars: int = 2000
    name: str = "python"
    description: str = "runs a Python 3 program and returns what it prints (no network, no files kept)"
    schema: ClassVar[dict] = default_parameters("code")  # the program, as the model's JSON arguments carry it

    def __call__(self, arguments: str) -> ToolResult:
        code = arguments.strip("\n")
        if not code.strip():
            return ToolResult.failed("empty program")
        workdir = tempfile.mkdtemp(prefix="milestone-python-")
        try:
            with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as fh:
                fh.write(code)
            cmd = [*net_isolation_prefix(), sys.executable, "-I", "-c", _PRELUDE,
                   str(self.cpu_s), str(self.memory_mb << 20)]
            env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir, "PYTHONHASHSEED": "0"}
            proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            t0 = time.monotonic()
            try:
                out, err = proc.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return ToolResult.failed(f"timed out after {self.timeout_s:g} s (wall clock)", timed_out=True)
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
            return self._result(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"),
                                time.monotonic() - t0)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _result(self, rc: int, out: str, err: str, _seconds: float) -> ToolResult:
        out = out[-self.max_output_chars:]
        if rc == 0:
            return ToolResult(output=out)
        if rc in (-signal.SIGXCPU, -signal.SIGKILL) and not err.strip():
            why = f"killed by signal {-rc} (CPU limit {self.cpu_s} s)"
        elif rc < 0:
            why = f"killed by signal {-rc}"
        else:
            tail = err.strip().splitlines()[-1:] or [f"exit status {rc}"]
            why = tail[0]
        if "MemoryError" in err:
            why = f"MemoryError (memory limit {self.memory_mb} MB)"
        return ToolResult.failed(why[-self.max_output_chars:], output=out)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (its pid leads it), then reap it."""
    signal_group(proc.pid, signal.SIGKILL, proc)
    proc.communicate()
