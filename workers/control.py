"""Orchestration worker: ``python -m workers.control``.

Runs the ``TrainingRun`` workflow and its step children (``RLStep``, ``SFTStep``) and the light CPU activities
on the control task queue: dataset preparation.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from typing import Any
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

from temporalio.worker import Worker

from activities.control import fence_placement, prepare_data
from gpu_runtime.proc import metrics
from workers.common import connect, install_shutdown, parse_worker_args, setup_logging
from workflows.queues import CONTROL_QUEUE
from workflows.training_run import RUN_WORKFLOWS

log = logging.getLogger("workers.control")
CONTROL_ACTIVITIES: list[Callable[..., Any]] = [prepare_data, fence_placement]


async def run(address: str | None, namespace: str | None) -> None:
    client = await connect(address, namespace)
    stop = asyncio.Event()
    install_shutdown(stop)
    with ThreadPoolExecutor(max_workers=8) as pool:
        worker = Worker(
            client,
            task_queue=CONTROL_QUEUE,
            workflows=RUN_WORKFLOWS,
            activities=CONTROL_ACTIVITIES,
            activity_executor=pool,
            graceful_shutdown_timeout=timedelta(seconds=5),
        )
        log.info("control worker polling %s", CONTROL_QUEUE)
        async with worker:
            await stop.wait()
    log.info("control worker stopped")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    args = parse_worker_args(p, argv)
    metrics.serve(args.metrics_port, args.metrics_host)
    setup_logging("control")
    asyncio.run(run(args.address, args.namespace))


if __name__ == "__main__":
    main()
