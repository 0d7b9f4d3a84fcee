"""``children.json`` in a node agent's work dir: the pids of its trainer, router and engines, each
with its process identity, so that ``make down`` and the tests can stop what a SIGKILLed agent left
behind, and only that.

A pid alone names no process for long: the kernel gives the number out again once its counter
wraps (``pid_max`` is 32768 on this repo's machines; a CI run wraps it). A child that died
minutes ago may have handed its number to anyone, so a reader stops a recorded pid only while
the process that has it started when the recorded one did (``processes.process_identity``).

Written whole then renamed: a reader never sees a half-written file."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from gpu_runtime.proc.processes import process_identity, stop_pid

FILE = "children.json"


def write_children(work_dir: Path, *, trainer: int | None, router: int | None, engines: list[int | None]) -> None:
    """This agent's children as they are now (the agent's own pid too, for a test aiming a kill)."""
    identities = {str(p): i for p in (trainer, router, *engines) if p and (i := process_identity(p)) is not None}
    body = {"agent": os.getpid(), "trainer": trainer, "router": router, "engines": engines, "identities": identities}
    tmp = work_dir / f"{FILE}.{threading.get_ident()}.tmp"
    tmp.write_text(json.dumps(body))
    os.replace(tmp, work_dir / FILE)


def read_children(work_dir: Path) -> dict:
    """``{"agent", "trainer", "router", "engines": [...], "identities"}`` as last written; {} if none."""
    path = work_dir / FILE
    return json.loads(path.read_text()) if path.exists() else {}


def left_behind(work_dir: Path) -> list[tuple[int, str]]:
    """(pid, identity) of each recorded trainer, router and engine still running as the process
    recorded (a pid given to another process since is not in it)."""
    body = read_children(work_dir)
    recorded = body.get("identities", {})
    out = []
    for pid in [body.get("trainer"), body.get("router"), *body.get("engines", [])]:
        identity = recorded.get(str(pid)) if pid else None
        if identity is not None and process_identity(pid) == identity:
            out.append((pid, identity))
    return out


def stop_left_behind(work_dir: Path) -> None:
    """Stop (``stop_pid``, each with its group) the children :func:`left_behind` names."""
    for pid, identity in left_behind(work_dir):
        stop_pid(pid, identity=identity)


def remove_children(work_dir: Path) -> None:
    (work_dir / FILE).unlink(missing_ok=True)
