"""A DP cell's process as its group (``dp.group``) sees it: its pid, its RPC client, whether
it is alive, lost (and why) or starting, its last report; and ``watched``, which waits on a
call while a check (the cell's health) may give up on it."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from gpu_runtime.proc.processes import stop_pid
from gpu_runtime.proc.rpc import RPCClient
from gpu_runtime.trainer.dp.cell_rpc import CellReport
from spec.status import CellState

T = TypeVar("T")


class Silent(Exception):
    """A cell answered neither a call nor its health check for too long."""


def watched(fn: Callable[[], T], check: Callable[[], None], every_s: float) -> T:
    """``fn()`` on a thread while ``check()`` runs on this one every ``every_s`` until it
    returns; ``check`` may raise to stop waiting (``fn``'s thread is then left to end)."""
    results: list[T] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            results.append(fn())
        except BaseException as err:  # noqa: BLE001 - raised below, on the caller's thread
            errors.append(err)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    while not done.wait(every_s):
        check()
    if errors:
        raise errors[0]
    return results[0]


@dataclass
class CellProcess:
    index: int
    proc: subprocess.Popen | None = None
    client: RPCClient | None = None
    state: CellState = CellState.STARTING
    why: str = ""  # why it was lost
    report: CellReport | None = None
    healed_from_step: int | None = None
    restarts: int = 0
    joining: bool = False  # restarted, not yet through a step: it must join the quorum first

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def end(self, timeout_s: float = 10.0) -> None:
        """Stop the cell's process by pid (``stop_pid`` continues a SIGSTOPped one)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        stop_pid(self.proc.pid, self.proc, timeout_s=timeout_s)


__all__ = ["CellProcess", "Silent", "watched"]
