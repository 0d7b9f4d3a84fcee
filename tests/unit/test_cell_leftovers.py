"""``end_recorded``: what a SIGKILLed trainer process's Ray left behind is ended by its
successor, by recorded pid and start time only (a reused pid is left alone)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil

from gpu_runtime.trainer.fsdp2.ray_runtime import end_recorded


def test_recorded_processes_are_ended_and_reused_pids_spared(tmp_path: Path) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(2)]
    try:
        ours, other = procs
        record = {str(ours.pid): psutil.Process(ours.pid).create_time(),
                  str(other.pid): psutil.Process(other.pid).create_time() - 5.0}  # "the pid was reused"
        pid_file = tmp_path / "ray-pids.json"
        pid_file.write_text(json.dumps({"pids": record, "temp_dir": str(tmp_path / "not-a-ray-dir")}))
        assert end_recorded(pid_file) == [ours.pid]
        assert ours.wait(timeout=10) == -9
        assert other.poll() is None
        assert not pid_file.exists()
        assert end_recorded(pid_file) == []  # nothing recorded: nothing to do
    finally:
        for p in procs:
            p.kill()
            p.wait()
