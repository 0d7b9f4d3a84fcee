"""The dev server's SQLite store runs in WAL mode (``infra.temporal_server.SQLITE_PRAGMAS``):
the rollback journal's disk syncs were most of every workflow task's time
(docs/rollout-modes.md, "Where the step time goes")."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from gpu_runtime.proc.processes import free_port, spawn, stop_pid
from infra.temporal_server import server_command, wait_for_port, wait_until_serving


def test_the_store_is_in_wal_mode_with_full_sync(tmp_path: Path) -> None:
    port, db = free_port(), tmp_path / "t.db"
    proc = spawn(server_command(db, port, None), tmp_path / "temporal.log")
    try:
        wait_for_port("127.0.0.1", port, 60, proc)
        wait_until_serving(f"127.0.0.1:{port}", 60)
        with sqlite3.connect(db) as conn:  # journal_mode is recorded in the file; a reader sees it
            assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert (tmp_path / "t.db-wal").exists()
        assert "synchronous=full" in server_command(db, port, None)  # acknowledged commits are on disk
    finally:
        stop_pid(proc.pid, proc)
