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

PY = shlex.quote(sys.executable)


def _script(tmp: Path, name: str, code: str) -> str:
    """``python <file>`` as a shell line (the install command is one)."""
    f = tmp / f"{name}.py"
    f.write_text(code)
    return f"{PY} {shlex.quote(str(f))}"


def _run(tmp: Path, install: str, command: str) -> tuple[int, dict, str]:
    status = tmp / "install.json"
    p = subprocess.Popen([sys.executable, "-m", "infra.alongside", "--install", install, "--status", str(status),
                          "--", sys.executable, "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
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
    waits = ("import json, os, time\n"
             "p = os.environ['MILESTONE_INSTALL_STATUS']\n"
             "while 'rc' not in json.load(open(p)): time.sleep(0.05)\n"
             f"assert json.load(open(p))['rc'] == 0 and os.path.exists({str(marker)!r})\n")
    rc, status, out = _run(tmp_path, _script(tmp_path, "install", f"import pathlib; pathlib.Path({str(marker)!r}).touch()"),
                           waits)
    assert rc == 0, out
    assert status["rc"] == 0 and Path(status["log"]).exists()


def test_a_failed_install_fails_a_passing_command(tmp_path: Path) -> None:
    rc, status, out = _run(tmp_path, _script(tmp_path, "install", "import sys; print('no space'); sys.exit(3)"), "pass")
    assert rc == 3 and status["rc"] == 3, out
    assert "no space" in Path(status["log"]).read_text()


def test_a_failed_command_stops_the_running_install_by_its_pid(tmp_path: Path) -> None:
    """The install (and what it started: its process group) ends with the failed command."""
    child = tmp_path / "child.pid"
    install = _script(tmp_path, "install", "import subprocess, sys, time\n"
                      "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                      f"open({str(child)!r}, 'w').write(str(c.pid))\ntime.sleep(600)\n")
    command = f"import os, time\nwhile not os.path.exists({str(child)!r}): time.sleep(0.05)\nraise SystemExit(7)"
    rc, status, out = _run(tmp_path, install, command)
    assert rc == 7, out
    assert status["rc"] != 0
    grandchild = int(child.read_text())
    wait_for(lambda: not pid_alive(grandchild), 30, what="the install's child stopped with its group")
