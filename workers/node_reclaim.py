"""A node agent reclaims the files of runs that have closed (``gpu_runtime.node.reclaim``).

When does a run's node stop needing its files? When the run has closed: completed,
failed, terminated, cancelled or timed out, which Temporal knows (``describe`` of the
run's workflow: not RUNNING; a run id Temporal does not know: reclaimed too). A run
that only moved to another node is still RUNNING and keeps its files here (it may come
back: then a later call restores from the store anyway). The agent asks

- when a run's liveness watch ends on this node (the run ended or left it): a few times
  over about a minute, as the run closes just after it stops its watch;
- at agent start (runs that closed while the agent was down) and every ``sweep_s``
  (runs that moved away and closed later elsewhere).

A run watched or claimed here is never reclaimed, whatever Temporal says. Before its
files go, the trainer process drops what it holds for the run (``forget_run``: its
background uploads finish first). The engines stay up: they hold no file of the run
open (they loaded their weights), the next run's ``update_weights`` gives them its own
weights, and restarting them costs the next run their start-up (minutes for vLLM or
SGLang). An error while asking leaves the files for the next time, with a log line.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from gpu_runtime.node.reclaim import reclaim_run, remove_trash, run_paths, runs_on_node
from gpu_runtime.node.runtime import NodeRuntime
from gpu_runtime.proc import metrics

log = logging.getLogger(__name__)
SWEEP_S = 600.0
AFTER_WATCH_S = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0)  # asked again after each (the run closes just after its watch ends)


class RunReclaimer:
    def __init__(
        self, client: Client, runtime: NodeRuntime, live: Callable[[], set[str]], *,
        sweep_s: float = SWEEP_S, after_watch_s: tuple[float, ...] = AFTER_WATCH_S,
    ) -> None:
        self.client = client
        self.rt = runtime
        self.live = live  # runs watched or claimed on this node now
        self.sweep_s = sweep_s
        self.after_watch_s = after_watch_s
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    async def closed(self, run_id: str) -> bool | None:
        """Whether the run's workflow has closed (or never existed); None: could not tell."""
        try:
            desc = await self.client.get_workflow_handle(run_id).describe()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return True
            log.warning("reclaim: cannot tell whether run %s has closed (%s); its files stay for now", run_id, err)
            return None
        except Exception as err:  # the server is down, a timeout: try again at the next sweep
            log.warning("reclaim: cannot tell whether run %s has closed (%s: %s); its files stay for now",
                        run_id, type(err).__name__, err)
            return None
        return desc.status != WorkflowExecutionStatus.RUNNING

    async def reclaim_if_closed(self, run_id: str) -> bool | None:
        """Reclaim the run's files when it has closed: True reclaimed (or nothing was left),
        False it runs (here or elsewhere), None could not tell or failed."""
        async with self._lock:
            if run_id in self.live():
                return False
            closed = await self.closed(run_id)
            if not closed:
                return closed
            if run_id in self.live():  # claimed here again meanwhile (a resumed run)
                return False
            try:
                reclaimed = await asyncio.to_thread(self._reclaim, run_id)
            except Exception as err:
                log.warning("reclaim of run %s failed (%s: %s); retried at the next sweep", run_id,
                            type(err).__name__, err)
                return None
            return reclaimed is not None

    def _reclaim(self, run_id: str) -> int | None:
        work_dir = self.rt.work_dir
        if not run_paths(work_dir, run_id):
            return 0
        if self.rt.trainer.alive():  # a new trainer process holds nothing of any run
            forgot = self.rt.trainer.forget_run(run_id)
            if forgot.held and not forgot.uploads_done:
                log.warning("run %s: the trainer let go with checkpoint uploads unfinished", run_id)
        self.rt.setups.pop(run_id, None)
        reclaimed = reclaim_run(work_dir, run_id)
        metrics.RECLAIMED_BYTES.inc(reclaimed)
        log.info("reclaimed %d bytes of closed run %s on node %s", reclaimed, run_id, self.rt.node_id)
        return reclaimed

    def run_left(self, run_id: str) -> None:
        """A run's liveness watch ended here (on the agent's event loop): reclaim its files
        once the run has closed, asked a few times while it closes."""
        task = asyncio.get_running_loop().create_task(self._after_watch(run_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _after_watch(self, run_id: str) -> None:
        for delay in self.after_watch_s:
            await asyncio.sleep(delay)
            if await self.reclaim_if_closed(run_id) is not False:
                return

    async def sweep(self) -> None:
        """Every run with files here: reclaimed if it has closed."""
        await asyncio.to_thread(remove_trash, self.rt.work_dir)
        for run_id in sorted(await asyncio.to_thread(runs_on_node, Path(self.rt.work_dir))):
            await self.reclaim_if_closed(run_id)

    async def run_forever(self) -> None:
        """A sweep at start, then every ``sweep_s``."""
        while True:
            try:
                await self.sweep()
            except Exception:  # never ends the agent: the next sweep tries again
                log.exception("reclaim sweep failed")
            await asyncio.sleep(self.sweep_s)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
