"""A local Ray head for fsdp2 cells: ``ray start --head --block``, started and stopped by pid.

``make up`` starts one (when the ``cells`` extra is installed) and hands its address to
the node agent as ``$MILESTONE_RAY_ADDRESS``; a trainer then places its cells on it and
owns only its placement groups and actors. ``--block`` keeps the head's processes under
one pid we started; ``stop_head`` ends that pid and every process of the head it can
find (its descendants and its process group), never ``ray stop`` (which would end every
Ray instance on the machine, another user's included).
"""

from __future__ import annotations

import os
import sys
import shutil
import signal
import time
from pathlib import Path

import psutil

from gpu_runtime.trainer.fsdp2.ray_runtime import RAY_WORKER_ENV

RAY_HEAD_PORT = int(os.environ.get("MILESTONE_RAY_PORT", "6379"))  # Ray's default GCS port


def ray_executable() -> str | None:
    """The ``ray`` command next to this Python (the ``cells`` extra), else on PATH."""
    here = Path(sys.executable).with_name("ray")
    return str(here) if here.exists() else shutil.which("ray")


def head_env() -> dict[str, str]:
    """Ray 2.60 asks for a token unless told otherwise (the head is for this machine: its
    workers register as 127.0.0.1, though GCS itself listens on every interface)."""
    return {"RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"), "RAY_USAGE_STATS_ENABLED": "0",
            **{k: os.environ.get(k, v) for k, v in RAY_WORKER_ENV.items()}}


def _ray() -> str:
    ray = ray_executable()
    if ray is None:
        raise FileNotFoundError("the ray command is not installed (pip install -e '.[cells]')")
    return ray


def head_command(port: int, temp_dir: Path, num_cpus: int, node_ip: str = "127.0.0.1") -> list[str]:
    """``ray start --head --block`` on ``node_ip`` (the address its raylet registers: other
    hosts' raylets and the cell's ranks reach it there; 127.0.0.1 keeps it to this machine)."""
    return [_ray(), "start", "--head", "--block", "--port", str(port), "--node-ip-address", node_ip,
            "--num-cpus", str(num_cpus), "--temp-dir", str(temp_dir.resolve()), "--include-dashboard", "false",
            "--disable-usage-stats"]


def worker_command(head: str, temp_dir: Path, num_cpus: int, node_ip: str) -> list[str]:
    """``ray start --block`` of a worker raylet on ``node_ip`` joining the cluster whose head
    (its GCS) is ``head`` (``host:port``): a second machine's CPUs for a ``spread`` cell.
    Stopped as a head is, by pid (``stop_head``)."""
    return [_ray(), "start", "--block", "--address", head, "--node-ip-address", node_ip,
            "--num-cpus", str(num_cpus), "--temp-dir", str(temp_dir.resolve()), "--disable-usage-stats"]


def head_processes(pid: int) -> list[psutil.Process]:
    """The head's processes: ``pid``, its descendants and its process group's members."""
    out: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(pid)
        out[pid] = root
        out.update({p.pid: p for p in root.children(recursive=True)})
    except psutil.NoSuchProcess:
        pass
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pid:
                out[p.pid] = p
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass
    return list(out.values())


def stop_head(pid: int, timeout_s: float = 20.0) -> list[int]:
    """SIGTERM the head's ``ray start --block`` process (it stops what it started), then
    SIGKILL whatever of it is left after ``timeout_s``. Returns the pids killed."""
    procs = head_processes(pid)
    for p in procs:
        if p.pid == pid:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.NoSuchProcess:
                pass
    deadline = time.monotonic() + timeout_s
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed = []
    for p in _alive(procs):
        try:
            p.kill()
            killed.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + 5
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return killed


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_ready(pid: int, port: int, timeout_s: float = 120.0) -> None:
    """Until the head's GCS answers on ``port`` (a head that exits first is an error)."""
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            raise RuntimeError(f"the Ray head (pid {pid}) exited before serving on port {port}")
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                time.sleep(1.0)  # the GCS listens before the raylet registers: let it
                return
        time.sleep(0.2)
    raise TimeoutError(f"the Ray head (pid {pid}) did not serve on 127.0.0.1:{port} within {timeout_s:.0f} s")


__all__ = ["RAY_HEAD_PORT", "head_command", "head_env", "head_processes", "ray_executable", "stop_head", "wait_ready",
           "worker_command"]
