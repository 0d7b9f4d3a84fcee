"""Your agent's code for one episode, in a process of its own, ended on our terms.

One process per episode: an agent that crashes, leaks or hangs is killed (its whole process
group, by pid) without touching the node agent or the chunk's other episodes, and its
wall-clock budget is its own. The processes are forked by the chunk's zygote
(``agent_child``), which imported your module once, so an episode costs a fork, not an
interpreter and your imports.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from gpu_runtime.proc.processes import process_identity, signal_group

log = logging.getLogger(__name__)
LOG_TAIL = 2000
FORK_TIMEOUT_S = 60.0  # the zygote imports the entrypoint before its first fork


@dataclass(frozen=True)
class AgentExit:
    status: str  # completed | agent_error (raised, or exited without a result) | timeout | killed (a signal from outside) | stopped
    answer: str | None = None
    error: str = ""
    pid: int = 0
    seconds: float = 0.0


@dataclass
class _Job:
    zygote: int  # the pid of the zygote asked to fork it
    pid: int = 0
    identity: str | None = None  # processes.process_identity of pid, read when it was forked
    exit: int | None = None
    lost: bool = False  # the zygote died: this process's end is unknown (it was killed)
    forked: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)


class AgentZygote:
    """A chunk's episodes' processes, forked by one zygote that imported ``entrypoint``. Started
    on first use, again if it died; ``close`` waits for it (it exits once its episodes have)."""

    def __init__(self, entrypoint: str) -> None:
        self.entrypoint = entrypoint
        self._proc: subprocess.Popen[bytes] | None = None
        self._jobs: dict[int, _Job] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._ended: set[int] = set()  # zygotes whose output ended (dead, even if not reaped yet)
        self.import_error = ""

    def __enter__(self) -> AgentZygote:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _live(self) -> subprocess.Popen[bytes]:
        """The zygote, started if there is none or it died (called with the lock held). A zygote
        whose output ended counts as dead before it is reaped: its end is reported before the
        kernel lets ``poll`` see it."""
        if self._proc is None or self._proc.pid in self._ended or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "gpu_runtime.rollout.agent.agent_child", self.entrypoint, str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
            threading.Thread(target=self._read, args=(self._proc,), name="agent-zygote", daemon=True).start()
        return self._proc

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            msg = json.loads(line)
            if "import_error" in msg:
                self.import_error = msg["import_error"]
                with self._lock:
                    for waiting in self._jobs.values():  # the zygote forks nothing: every waiting job ends
                        waiting.forked.set()
                        waiting.ended.set()
                continue
            with self._lock:
                found = self._jobs.get(msg["episode"])
            if found is None:
                continue
            if "pid" in msg:
                found.pid = int(msg["pid"])
                found.identity = process_identity(found.pid)
                found.forked.set()
            else:
                found.exit = int(msg["exit"])
                found.ended.set()
        with self._lock:  # the zygote is gone: its episodes' ends will never be reported
            self._ended.add(proc.pid)
            for job in self._jobs.values():
                if job.zygote == proc.pid and not job.ended.is_set():
                    job.lost = True
                    _kill_group(job)
                    job.forked.set()
                    job.ended.set()
        proc.wait()

    def run(
        self, base_url: str, api_key: str, row: dict, *, timeout_s: float,
        on_start: Callable[[int], None] = lambda _pid: None, should_stop: Callable[[], bool] = lambda: False,
        poll_s: float = 0.05,
    ) -> AgentExit:
        """``entrypoint(base_url, api_key, row)`` in a forked process; its end within ``timeout_s``."""
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="milestone-agent-") as tmp:
            result, out = Path(tmp) / "result.json", Path(tmp) / "output.log"
            job_id = next(self._ids)
            with self._lock:  # a job is only ever given to a zygote whose end has not been seen
                proc = self._live()
                job = self._jobs[job_id] = _Job(zygote=proc.pid)
            try:
                assert proc.stdin is not None
                line = json.dumps({"episode": job_id, "base_url": base_url, "api_key": api_key, "row": row,
                                   "result": str(result), "log": str(out)})
                try:
                    proc.stdin.write(line.encode() + b"\n")
                    proc.stdin.flush()
                except (BrokenPipeError, ValueError):  # it died: its reader marks this job lost
                    pass
                deadline = time.monotonic() + FORK_TIMEOUT_S
                while not job.forked.wait(poll_s) and not self.import_error and time.monotonic() < deadline:
                    pass
                if not job.forked.is_set() or self.import_error:
                    return AgentExit("agent_error", error=self.import_error or "the agent zygote did not fork in "
                                     f"{FORK_TIMEOUT_S:g} s", seconds=time.monotonic() - t0)
                if job.pid:
                    on_start(job.pid)
                ended_by_us = ""
                while not job.ended.wait(poll_s):
                    if time.monotonic() - t0 > timeout_s:
                        ended_by_us = "timeout"
                    elif should_stop():
                        ended_by_us = "stopped"
                    if ended_by_us:
                        _kill_group(job)
                        job.ended.wait(10.0)
                        break
                _kill_group(job)  # whatever it started and left behind, in its group
                return _exit(job, ended_by_us, result, out, timeout_s, time.monotonic() - t0)
            finally:
                with self._lock:
                    self._jobs.pop(job_id, None)

    def close(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL, proc)
            proc.wait()


def _exit(job: _Job, ended_by_us: str, result: Path, out: Path, timeout_s: float, seconds: float) -> AgentExit:
    if ended_by_us == "timeout":
        return AgentExit("timeout", error=f"the agent ran past agent.episode_timeout_s ({timeout_s:g} s)",
                         pid=job.pid, seconds=seconds)
    if ended_by_us:
        return AgentExit("stopped", error="stopped: the rollout failed", pid=job.pid, seconds=seconds)
    if result.exists():
        body = json.loads(result.read_text())
        if body["ok"]:
            return AgentExit("completed", answer=body["answer"], pid=job.pid, seconds=seconds)
        return AgentExit("agent_error", error=body["error"], pid=job.pid, seconds=seconds)
    if job.lost or job.exit is None:
        return AgentExit("killed", error="killed with the agent zygote", pid=job.pid, seconds=seconds)
    if job.exit < 0:
        return AgentExit("killed", error=f"killed by {signal.Signals(-job.exit).name}", pid=job.pid, seconds=seconds)
    tail = out.read_bytes()[-LOG_TAIL:].decode(errors="replace") if out.exists() else ""
    return AgentExit("agent_error", error=f"exited with code {job.exit} before returning: {tail}", pid=job.pid,
                     seconds=seconds)


def _kill_group(job: _Job) -> None:
    """SIGKILL the episode's process group: its leader may have ended (the zygote reaped it), and
    the group's id is never another process's (``processes.group_is_ours``)."""
    if job.pid > 0:
        signal_group(job.pid, signal.SIGKILL, identity=job.identity)


class Zygotes:
    """The node's agent zygotes, one per (run, entrypoint), kept from step to step so a run imports
    its agent's module (and warms the ``openai`` SDK) once per node, not once per rollout. Asking
    for another run's closes the others: a node agent serves one run at a time, and a new run
    (or a resumed one) imports the module as it is then."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], AgentZygote] = {}
        self._lock = threading.Lock()

    def get(self, run_id: str, entrypoint: str) -> AgentZygote:
        with self._lock:
            key = (run_id, entrypoint)
            for other in [k for k in self._by_key if k != key]:
                self._by_key.pop(other).close()
            if key not in self._by_key:
                self._by_key[key] = AgentZygote(entrypoint)
            return self._by_key[key]

    def close(self) -> None:
        with self._lock:
            for zygote in self._by_key.values():
                zygote.close()
            self._by_key.clear()


ZYGOTES = Zygotes()  # the node agent's (its episodes' processes exit with it)
