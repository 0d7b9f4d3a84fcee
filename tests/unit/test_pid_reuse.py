"""Signals aimed by a pid never reach a process the kernel gave that number to later.

The kernel hands pids out in turn and starts again at ``pid_max`` (32768 on this repo's
machines, wrapped during a CI run), so a pid read from ``children.json`` or kept in a reaped
``Popen`` may be another process's by the time it is signalled. CI lost a module's Temporal
server mid-run ("tcp connect error" on every call, the server gone) while other modules were
stopping processes by such pids; every process we start leads its own session, so a stale
``killpg`` lands on a whole server.

The reuse is real, not simulated: ``tests/scripts/pid_reuse.py`` runs as pid 1 of a new pid
namespace, where setting ``ns_last_pid`` makes the kernel give a freed number to the next
process at once (the root namespace, which parallel tests share, is not touched). Needs root,
as the multi-host tests do; without it the test fails and says so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_runtime.proc.processes import process_identity, stop_pid

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reuse() -> dict:
    assert os.geteuid() == 0 and shutil.which("unshare"), "needs root and unshare (util-linux) for a pid namespace"
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "tests.scripts.pid_reuse"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_kernel_gives_a_freed_number_to_a_new_process(reuse: dict) -> None:
    assert reuse["pid_namespace_init"] and reuse["reused"]
    assert reuse["raw_killpg_reaches_new"]  # what a signal by number alone would have hit


def test_stop_pid_and_signal_group_spare_the_process_that_took_the_number(reuse: dict) -> None:
    assert reuse["stop_pid_spares_new"]
    assert not reuse["signal_group_sent"] and not reuse["group_is_ours_by_identity"]
    assert reuse["new_still_running"] and reuse["pending_seen"]


def test_children_json_stops_only_the_processes_it_recorded(reuse: dict) -> None:
    assert reuse["recorded_live"]
    assert reuse["recorded_after_reuse"] == []


def test_a_dead_leaders_group_keeps_its_number_and_is_stopped(reuse: dict) -> None:
    assert reuse["member_pgid"] and reuse["number_held_by_group"]
    assert reuse["survivors_signalled"] and reuse["member_gone"]


def test_a_pid_alone_is_refused() -> None:
    with pytest.raises(ValueError, match="pass proc or identity"):
        stop_pid(os.getpid())


def test_identity_names_this_boot_and_start_time() -> None:
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    mine = process_identity(os.getpid())
    assert mine is not None and mine.startswith(boot + "/") and mine == process_identity(os.getpid())
    assert process_identity(2**22 + 1) is None  # above any pid_max: no such process
