"""The installs and commands ``tests/unit/test_alongside.py`` runs under ``infra.alongside``:
``python -m tests.scripts.alongside_programs <program> <args>``.

- ``touch <file>``: an install that creates ``file``.
- ``fail <text> <rc>``: an install that prints ``text`` and exits ``rc``.
- ``spawn_and_sleep <pid file>``: an install that starts a sleeping child, writes its pid
  to ``pid file`` and sleeps (stopped with its process group).
- ``await_install <file>``: a command that waits for the install's end in
  ``$MILESTONE_INSTALL_STATUS`` and fails unless it passed and left ``file``.
- ``exit_when <file> <rc>``: a command that waits for ``file``, then exits ``rc``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def touch(file: str) -> None:
    Path(file).touch()


def fail(text: str, rc: str) -> None:
    print(text)
    sys.exit(int(rc))


def spawn_and_sleep(pid_file: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(pid_file).write_text(str(child.pid))
    time.sleep(600)


def await_install(file: str) -> None:
    status = os.environ["MILESTONE_INSTALL_STATUS"]
    while "rc" not in json.loads(Path(status).read_text()):
        time.sleep(0.05)
    assert json.loads(Path(status).read_text())["rc"] == 0 and os.path.exists(file)


def exit_when(file: str, rc: str) -> None:
    while not os.path.exists(file):
        time.sleep(0.05)
    raise SystemExit(int(rc))


PROGRAMS: dict[str, Callable[..., None]] = {f.__name__: f for f in (touch, fail, spawn_and_sleep, await_install, exit_when)}

if __name__ == "__main__":
    PROGRAMS[sys.argv[1]](*sys.argv[2:])
