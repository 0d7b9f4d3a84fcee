"""infra/alongside.py, which `make test` uses to install .venv-vllm while the tests run: real
subprocesses for the install and the command."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from gpu_runtime.proc.processes import pid_alive
from tests.stack import wait_for


def _program(*args: str) -> list[str]:
    """``python -m tests.scripts.alongside_programs <args>``: an install or a command."""
    return [sys.executable, "-m", "tests.scripts.alongside_programs", *args]


def _run(tmp: Path, install: list[str], command: list[str]) -> tuple[int, dict, str]:
    """``command`` run under ``infra.alongside`` while ``install`` (a shell line there) runs."""
    status = tmp / "install.json"
    p = subprocess.Popen([sys.executable, "-m", "infra.alongside", "--install", shlex.join(install), "--status",
                          str(status), "--", *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, cwd=Path(__file__).resolve().parents[2], start_new_session=True)
    try:
        out, _ = p.communicate(timeout=120)
    finally:  # a hung run: its command and install go with it (their group), not only alongside itself
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, json.loads(status.read_text()), out


def test_the_command_sees_the_install_finish(tmp_path: Path) -> None:
    """The command reads the status file from $MILESTONE_INSTALL_STATUS and waits for rc 0."""
    marker = tmp_path / "made"
    rc, status, out = _run(tmp_path, _program("touch", str(marker)), _program("await_install", str(marker)))
    assert rc == 0, out
    assert status["rc"] == 0 and Path(status["log"]).exists()


def test_a_failed_install_fails_a_passing_command(tmp_path: Path) -> None:
    rc, status, out = _run(tmp_path, _program("fail", "no space", "3"), [sys.executable, "-c", "pass"])
    assert rc == 3 and status["rc"] == 3, out
    assert "no space" in Path(status["log"]).read_text()


def test_a_failed_command_stops_the_running_install_by_its_pid(tmp_path: Path) -> None:
    """The install (and what it started: its process group) ends with the failed command."""
    child = tmp_path / "child.pid"
    install = _program("spawn_and_sleep", str(child))
    command = _program("exit_when", str(child), "7")
    rc, status, out = _run(tmp_path, install, command)
    assert rc == 7, out
    assert status["rc"] != 0
    grandchild = int(child.read_text())
    wait_for(lambda: not pid_alive(grandchild), 30, what="the install's child stopped with its group")
