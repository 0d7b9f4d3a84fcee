"""``proc.stop_pid`` on real child processes: a SIGSTOPped process ends on the SIGTERM
(it is continued), not on the SIGKILL that follows ``timeout_s`` later."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from gpu_runtime.proc.processes import pid_alive, stop_pid

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _start() -> subprocess.Popen:
    return subprocess.Popen(SLEEPER, start_new_session=True)


def test_a_stopped_process_ends_on_its_sigterm() -> None:
    proc = _start()
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        # a long timeout: were the process not continued, it would end on the SIGKILL after it
        stop_pid(proc.pid, proc, timeout_s=120)
        assert proc.returncode == -signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_running_process_ends_on_its_sigterm_and_a_gone_one_is_a_no_op() -> None:
    proc = _start()
    stop_pid(proc.pid, proc, timeout_s=120)
    assert proc.returncode == -signal.SIGTERM and not pid_alive(proc.pid)
    stop_pid(proc.pid, proc, timeout_s=1)  # already gone: returns without raising
