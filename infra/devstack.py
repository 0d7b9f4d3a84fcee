"""The embedded stack on one machine: ``python -m infra.devstack up|down|status``.

``up`` starts the Temporal dev server (SQLite file and logs under ``.milestone/``,
UI on :8233, search attributes registered), ``python -m workers.control`` and one
``python -m workers.gpu --device cpu``. Every pid goes into ``.milestone/pids/``;
``down`` stops exactly those (process groups, by pid).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from gpu_runtime.proc import pid_alive, spawn, stop_pid
from infra.temporal_server import server_command, wait_for_port

log = logging.getLogger("devstack")
STATE = Path(os.environ.get("MILESTONE_HOME", ".milestone"))
TEMPORAL_PORT = 7233
UI_PORT = 8233
SERVICES = ("temporal", "control", "gpu")


def _pidfile(name: str) -> Path:
    return STATE / "pids" / f"{name}.pid"


def running(name: str) -> int | None:
    path = _pidfile(name)
    if not path.exists():
        return None
    pid = int(path.read_text().split()[0])
    return pid if pid_alive(pid) else None


def _start(name: str, cmd: list[str]) -> int:
    pid = running(name)
    if pid:
        log.info("%s already running (pid %d)", name, pid)
        return pid
    proc = spawn(cmd, STATE / "logs" / f"{name}.log")
    _pidfile(name).parent.mkdir(parents=True, exist_ok=True)
    _pidfile(name).write_text(str(proc.pid))
    log.info("%s started (pid %d), log %s", name, proc.pid, STATE / "logs" / f"{name}.log")
    return proc.pid


def up(node_id: str = "node0") -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    _start("temporal", server_command(STATE / "temporal.db", TEMPORAL_PORT, UI_PORT))
    wait_for_port("127.0.0.1", TEMPORAL_PORT, 60)
    wait_for_port("127.0.0.1", UI_PORT, 60)
    env_py = sys.executable
    _start("control", [env_py, "-m", "workers.control"])
    _start(
        "gpu",
        [env_py, "-m", "workers.gpu", "--device", "cpu", "--node-id", node_id, "--work-dir", str(STATE / "nodes" / node_id)],
    )
    print(f"Temporal UI: http://localhost:{UI_PORT}   (stop everything with: make down)")


def down() -> None:
    for name in reversed(SERVICES):
        pid = running(name)
        if pid:
            stop_pid(pid, timeout_s=20)
            log.info("%s stopped (pid %d)", name, pid)
        _pidfile(name).unlink(missing_ok=True)


def status() -> dict[str, int | None]:
    return {name: running(name) for name in SERVICES}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("action", choices=["up", "down", "status"])
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.action == "up":
        up()
    elif args.action == "down":
        down()
    else:
        for name, pid in status().items():
            print(f"{name:8s} {'pid ' + str(pid) if pid else 'stopped'}")


if __name__ == "__main__":
    main()
