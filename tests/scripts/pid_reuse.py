"""Run by ``tests/unit/test_pid_reuse.py`` as pid 1 of a new pid namespace (``unshare --pid
--fork --mount-proc``), where it may set ``ns_last_pid`` and so make the kernel hand a number
just freed to a new process, as it does in the root namespace once its counter wraps. Prints
one JSON object: what each signal aimed by a stale pid reached."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_runtime.node.children_file import left_behind, write_children
from gpu_runtime.proc.processes import group_is_ours, process_identity, signal_group, stop_pid

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
# blocks every signal it can, so one sent to it stays pending where /proc shows it (``pending``):
# whether a signal reached it is read, not waited for
SLEEPER = [sys.executable, "-c", "import signal, time; "
           "signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {signal.SIGKILL, signal.SIGSTOP}); "
           "print('ready', flush=True); time.sleep(600)"]


def session_leader() -> subprocess.Popen:
    proc = subprocess.Popen(SLEEPER, start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def pending(pid: int) -> int:
    """The signals sent to ``pid`` and not yet taken (all of them, as it blocks them)."""
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    return int(fields["ShdPnd"], 16) | int(fields["SigPnd"], 16)


def given_number(pid: int, was: str | None = None) -> subprocess.Popen | None:
    """A new session leader given ``pid`` (the kernel's next number is ns_last_pid + 1); None
    when the kernel gives it another number (``pid`` is still in use). Started in a later clock
    tick than the process recorded as ``was`` (identities resolve to a tick, 10 ms: a number
    comes round again in the root namespace only after the whole counter has, far later)."""
    for _ in range(100):
        NS_LAST_PID.write_text(str(pid - 1))
        proc = session_leader()
        if proc.pid == pid and process_identity(pid) != was:
            return proc
        proc.kill()
        proc.wait()
        if proc.pid != pid:
            return None
    raise AssertionError(f"pid {pid} given out only within the recorded process's clock tick")


def dead(proc: subprocess.Popen) -> int:
    """SIGKILL and reap ``proc``; its pid, free now."""
    proc.kill()
    proc.wait()
    return proc.pid


def main() -> None:
    out: dict[str, object] = {"pid_namespace_init": os.getpid() == 1}
    started: list[subprocess.Popen] = []
    try:
        # 1. stop_pid on our reaped child whose number a new session leader has now
        old = session_leader()
        identity = process_identity(old.pid)
        pid = dead(old)
        new = given_number(pid, identity)
        assert new is not None, "the kernel did not give the freed number out again"
        started.append(new)
        out["reused"] = new.pid == pid and process_identity(pid) != identity
        out["raw_killpg_reaches_new"] = _reaches(pid)  # what a signal by number alone would hit
        stop_pid(pid, old, timeout_s=1)
        out["stop_pid_spares_new"] = pending(pid) == 0 and new.poll() is None
        out["signal_group_sent"] = signal_group(pid, signal.SIGTERM, old)
        out["group_is_ours_by_identity"] = group_is_ours(pid, identity=identity)
        out["new_still_running"] = pending(pid) == 0 and new.poll() is None
        os.kill(pid, signal.SIGUSR1)  # the check can see a signal: one sent by hand is pending
        out["pending_seen"] = pending(pid) == 1 << (signal.SIGUSR1 - 1)

        # 2. children.json: a recorded engine that died and whose number was given out again
        work = Path(tempfile.mkdtemp())
        engine = session_leader()
        write_children(work, trainer=None, router=None, engines=[engine.pid])
        out["recorded_live"] = [p for p, _ in left_behind(work)] == [engine.pid]
        recorded = process_identity(engine.pid)
        taker = given_number(dead(engine), recorded)
        assert taker is not None
        started.append(taker)
        out["recorded_after_reuse"] = left_behind(work)

        # 3. a dead leader's group that still has a member: its number is not given out, and
        # a signal to the group reaches the member
        leader = subprocess.Popen(["sh", "-c", "sleep 600 & echo $!; wait"], stdout=subprocess.PIPE,
                                  start_new_session=True, text=True)
        assert leader.stdout is not None
        member = int(leader.stdout.readline())
        os.kill(leader.pid, signal.SIGKILL)  # the leader alone
        leader.wait()
        out["member_pgid"] = os.getpgid(member) == leader.pid
        blocked = given_number(leader.pid)
        out["number_held_by_group"] = blocked is None
        if blocked is not None:
            started.append(blocked)
        out["survivors_signalled"] = signal_group(leader.pid, signal.SIGKILL, leader)
        out["member_gone"] = _waited_gone(member)
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    print(json.dumps(out))


def _reaches(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _waited_gone(pid: int) -> bool:
    """Whether ``pid`` (an orphan: pid 1, this process, reaps it) ended within 10 s."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            return True
        time.sleep(0.02)
    return False


if __name__ == "__main__":
    main()
