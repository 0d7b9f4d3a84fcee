"""Run a command while an install runs in the background: ``make test`` installs the vLLM
engines' venv (``make install-vllm``: network and disk, a few minutes) while the CPU-bound
tests run, and the tests that need it wait for it (``tests/vllm_env.py``).

    python -m infra.alongside --install 'make install-vllm' --status .venv-vllm.install.json \\
        -- python -m pytest -n 3

The status file says where the install stands: ``{"pid": ..., "log": ...}`` while it runs,
``{"rc": 0 | n, "log": ...}`` once it ended; the command finds it through
``$MILESTONE_INSTALL_STATUS``. When the command ends first, the install is waited for if the
command passed (nothing is left half-written) and stopped by its pid if it failed. The exit
status is the command's, or the install's when only the install failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

STATUS_ENV = "MILESTONE_INSTALL_STATUS"


def write_status(path: Path, status: dict[str, object]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(status))
    tmp.replace(path)  # readers never see half a file


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--install", required=True, help="the install command, run in the background (a shell line)")
    p.add_argument("--status", required=True, type=Path, help="the status file the command reads")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run meanwhile")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command after --")
    status: Path = args.status.resolve()
    log = status.with_suffix(".log")
    with open(log, "wb") as out:
        install = subprocess.Popen(shlex.split(args.install), stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # its own group: stopped as one, by its pid
    write_status(status, {"pid": install.pid, "log": str(log)})
    print(f"alongside: `{args.install}` runs in the background (pid {install.pid}, log {log})", flush=True)

    def watch() -> None:
        rc = install.wait()
        write_status(status, {"rc": rc, "log": str(log)})
        print(f"alongside: `{args.install}` ended with {rc}", flush=True)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    rc = subprocess.call(command, env={**os.environ, STATUS_ENV: str(status)})
    if install.poll() is None and rc != 0:
        print(f"alongside: the command failed ({rc}): stopping the install (pid {install.pid})", flush=True)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(install.pid, sig)
            except ProcessLookupError:
                break
            try:
                install.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                continue
    watcher.join()
    install_rc = install.returncode
    if rc == 0 and install_rc != 0:
        print(f"alongside: the install failed ({install_rc}); its log: {log}", file=sys.stderr, flush=True)
        return install_rc or 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
