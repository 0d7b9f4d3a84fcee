"""Calls on a DP group's cells (``dp.group``): on one of them (they hold equal state), or on
every live cell at once, with the lost ones sorted out.

A cell whose RPC connection drops is lost; once one cell has answered, the others have
``timeout_s`` plus a grace, then are SIGKILLed by pid and lost (hung or stopped). A call on
one cell watches its /health meanwhile, so a stopped cell does not hold the call for its
600 s timeout. Restarted cells (``lead``) join torchft first and ask for their quorum
before the others do (see ``on_live``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel

from gpu_runtime.proc.rpc import RemoteError
from gpu_runtime.trainer.dp import cell_rpc
from gpu_runtime.trainer.dp.cell_process import CellProcess, Silent, watched
from gpu_runtime.trainer.dp.cell_rpc import CellReport, Empty
from gpu_runtime.trainer.dp.lighthouse import Lighthouse
from spec.rpc import RpcMethod
from spec.status import CellState

log = logging.getLogger(__name__)
A = TypeVar("A", bound=BaseModel)
M = TypeVar("M", bound=BaseModel)
STRAGGLER_GRACE_S = 10.0
START_TIMEOUT_S = 120.0
YOUNG_LIGHTHOUSE_S = 3.0  # a step waits up to this long after a lighthouse (re)start for every cell's heartbeat
PASSED_THROUGH = {"FloatingPointError": FloatingPointError, "ValueError": ValueError}  # deterministic: every cell raises it


class CellFanOut:
    def __init__(self, lighthouse: Lighthouse, timeout_s: float, live: Callable[[], list[CellProcess]],
                 lose: Callable[[CellProcess, str], None], all_lost: Callable[[str], BaseException]) -> None:
        self.lighthouse = lighthouse
        self.timeout_s = timeout_s
        self.live = live  # the group's live cells, in index order
        self.lose = lose  # the group marks a cell lost (its process ended, an event noted)
        self.all_lost = all_lost  # what a call raises when no cell is left (the group is then dead)

    def one(self, method: RpcMethod[A, M], arg: A) -> M:
        """``method`` on the first live cell (they are equal); a dead one is lost and the next
        asked, and so is a hung one (SIGSTOP), which would otherwise hold the call for its
        600 s timeout: its health check goes unanswered for ``timeout_s`` + a grace."""
        for c in self.live():
            try:
                return self._watched_call(c, method, arg)
            except ConnectionError as err:
                self.lose(c, f"died during {method.name}: {err}")
            except Silent:
                self.lose(c, f"no answer to {method.name} nor to its health check within "
                             f"{self.timeout_s + STRAGGLER_GRACE_S:.0f} s (hung or stopped)")
        raise self.all_lost(method.name)

    def _watched_call(self, c: CellProcess, method: RpcMethod[A, M], arg: A) -> M:
        """The call on a thread while this one checks the cell's /health each second (served
        by its own thread, so a long export answers it; a stopped process does not)."""
        client = c.client
        assert client is not None
        silent_since: float | None = None

        def check() -> None:
            nonlocal silent_since
            if client.healthy(timeout_s=1.0):
                silent_since = None
            elif silent_since is None:
                silent_since = time.monotonic()
            elif time.monotonic() - silent_since > self.timeout_s + STRAGGLER_GRACE_S:
                raise Silent()

        return watched(lambda: client.call(method, arg, timeout_s=max(self.timeout_s, 600.0)), check, 1.0)

    def on_live(self, method: RpcMethod[A, CellReport], arg: A, lead: list[CellProcess] | None = None,
                 quorum: bool = False) -> list[tuple[CellProcess, CellReport]]:
        """``method`` on every live cell at once. A cell whose connection drops is lost; once one
        has answered, the others have ``timeout_s`` + a grace, then are killed and lost.

        ``lead`` (restarted cells) are called first, and the others only once the lighthouse
        holds their quorum requests: torchft forms a "fast quorum" of the previous step's
        cells as soon as they have all asked, leaving out a cell that asks a moment later
        (which would then wait for a quorum nobody else joins)."""
        cells = self.live()
        lead = [c for c in (lead or []) if c in cells]
        cells = lead + [c for c in cells if c not in lead]
        if not cells:
            raise self.all_lost(method.name)
        if lead:  # restarted cells create their torchft managers now (see ``cell_server.join``)
            lead = self._join(lead)
            cells = [c for c in cells if c.state == CellState.ALIVE]  # still lead first
            if not cells:
                raise self.all_lost(method.name)
        results, errors = self._fan_out(method, arg, cells, len(lead), quorum)
        self._lose_silent(method.name, cells, results, errors)
        if not results:
            raise self._failed_everywhere(method.name, errors)
        by_index = {c.index: c for c in cells}
        return [(by_index[i], results[i]) for i in sorted(results)]

    def _fan_out(self, method: RpcMethod[A, CellReport], arg: A, cells: list[CellProcess], n_lead: int,
                 quorum: bool) -> tuple[dict[int, CellReport], dict[int, BaseException]]:
        """``method`` on ``cells`` (the first ``n_lead`` of them restarted ones), each on its
        own thread; the answers and errors by cell, once every cell answered or the
        stragglers' time after the first answer ran out."""
        results: dict[int, CellReport] = {}
        errors: dict[int, BaseException] = {}
        cond = threading.Condition()

        def run(c: CellProcess) -> None:
            assert c.client is not None
            try:
                r = c.client.call(method, arg)
                with cond:
                    results[c.index] = r
            except BaseException as err:  # noqa: BLE001 - sorted out by the caller
                with cond:
                    errors[c.index] = err
            with cond:
                cond.notify_all()

        threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in cells]
        if n_lead:  # a lone newcomer forms a quorum of its own when the lighthouse hears only it
            self._wait_status(self.lighthouse.heartbeating, len(cells), "heartbeating")
        elif quorum and self.lighthouse.age_s() < YOUNG_LIGHTHOUSE_S:
            self._wait_status(self.lighthouse.heartbeating, len(cells), "heartbeating",
                              timeout_s=YOUNG_LIGHTHOUSE_S - self.lighthouse.age_s())
        for i, t in enumerate(threads):
            if n_lead and i == n_lead:
                self._wait_status(self.lighthouse.pending_requests, n_lead, "waiting for a quorum")
            t.start()
        deadline: float | None = None
        with cond:
            while len(results) + len(errors) < len(cells):
                if results and deadline is None:
                    deadline = time.monotonic() + self.timeout_s + STRAGGLER_GRACE_S
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                if deadline is not None and wait == 0.0:
                    break
                cond.wait(timeout=wait if wait is not None else 1.0)
        return results, errors

    def _lose_silent(self, method: str, cells: list[CellProcess], results: dict[int, CellReport],
                     errors: dict[int, BaseException]) -> None:
        """The cells of a fan-out that did not answer in time, died, or could not heal: lost."""
        for c in cells:
            if c.index in results:
                continue
            err = errors.get(c.index)
            if err is None:
                self.lose(c, f"no answer to {method} within {self.timeout_s + STRAGGLER_GRACE_S:.0f} s of its "
                             "peers (hung or stopped)")
            elif isinstance(err, ConnectionError) or (c.proc is not None and c.proc.poll() is not None):
                self.lose(c, f"died during {method}: {err}")
            elif isinstance(err, RemoteError) and err.error_type == "NotHealed":  # restarted again by the run
                self.lose(c, f"not healed: {err.message}")

    def _failed_everywhere(self, method: str, errors: dict[int, BaseException]) -> BaseException:
        """What a fan-out no cell answered raises: the input's error every cell raised (the
        cells are fine), another cell error, or ``DPCellsLost``."""
        passed = [e for e in errors.values() if isinstance(e, RemoteError) and e.error_type in PASSED_THROUGH]
        if passed and self.live():  # the cells are fine: the input is not (every cell raises it)
            return PASSED_THROUGH[passed[0].error_type](passed[0].message)
        other = next((e for e in errors.values() if isinstance(e, RemoteError)), None)
        if other is not None and self.live():
            return RuntimeError(f"DP cells: {method}: {other}")
        return self.all_lost(method)

    def _join(self, cells: list[CellProcess]) -> list[CellProcess]:
        """``join`` on each restarted cell (its torchft manager connects to the lighthouse and
        heartbeats); those it fails for are lost."""
        joined = []
        for c in cells:
            assert c.client is not None
            try:
                c.report = c.client.call(cell_rpc.JOIN, Empty(), timeout_s=START_TIMEOUT_S)
                joined.append(c)
            except (ConnectionError, RemoteError) as err:
                self.lose(c, f"could not join torchft: {err}")
        return joined

    def _wait_status(self, count: Callable[[], int], n: int, what: str, timeout_s: float = 60.0) -> None:
        """Until the lighthouse's /status page counts ``n`` cells ``what``; after ``timeout_s``
        go on anyway (a cell that cannot heal then refuses the step: ``NotHealed``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if count() >= n:
                return
            time.sleep(0.02)
        log.warning("the lighthouse did not count %d cell(s) %s within %.0f s", n, what, timeout_s)


__all__ = ["PASSED_THROUGH", "START_TIMEOUT_S", "STRAGGLER_GRACE_S", "CellFanOut"]
