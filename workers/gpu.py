"""Node agent: ``python -m workers.gpu --device cpu`` (or ``--device cuda [--trainer-gpu 0] [--engine-gpus 0,1]``).

Owns this node's trainer process and rollout engines. Listens on its own queue
``node-<node_id>-<boot_id>`` (a restarted process gets a new boot id, so work that
assumes warm state never lands on a cold process) and on the shared pool queue,
used only to claim a node for a run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import Worker

from activities.node import NodeActivities
from gpu_runtime.proc.devices import cuda_device_count, parse_gpu_list, plan_placement
from gpu_runtime.node.runtime import NodeRuntime
from gpu_runtime.proc import metrics
from spec.events import RunEvent
from workers.common import connect, install_shutdown, parse_worker_args, setup_logging
from workers.node_reclaim import RunReclaimer
from workflows.queues import POOL_QUEUE, ROLLOUT_POOL_QUEUE
from gpu_runtime.engine.auth import check_exposure, engine_token
from gpu_runtime.weight_sync.http_server import WeightServer
from workflows.training_run import TrainingRun

log = logging.getLogger("workers.gpu")
LIVENESS_THROTTLE = timedelta(seconds=0.5)


def run_reporter(client: Client, loop: asyncio.AbstractEventLoop) -> Callable[[str, RunEvent], None]:
    """Send a run an event from an activity thread (the ``node_event`` signal of
    ``TrainingRun``): what a node has to say after the run stopped awaiting its results."""

    def report(run_id: str, event: RunEvent) -> None:
        signal = client.get_workflow_handle(run_id).signal(TrainingRun.node_event, event)
        try:
            asyncio.run_coroutine_threadsafe(signal, loop).result(timeout=15)
        except Exception as err:  # the run may be over; the agent's log keeps the event
            log.warning("could not report %s to run %s: %s", event.kind, run_id, err)

    return report


async def run(args: argparse.Namespace) -> None:
    boot_id = uuid.uuid4().hex[:8]
    work_dir = Path(args.work_dir or f".milestone/nodes/{args.node_id}").resolve()
    trains = args.role == "any"
    runtime = NodeRuntime(
        args.node_id, boot_id, work_dir, engine_threads=args.engine_threads, trainer_threads=args.trainer_threads,
        placement=args.placement, trains=trains,
    )
    await asyncio.to_thread(runtime.start)
    client = await connect(args.address, args.namespace)
    acts = NodeActivities(runtime, report=run_reporter(client, asyncio.get_running_loop()))
    # the versions this node's trainer exports, for the run's rollout nodes to pull (engines.nodes)
    weights = WeightServer(args.advertise_host, args.weights_port, resolve=acts.version_folder, token=engine_token())
    if trains:
        weights.start()
        runtime.weights_url = weights.url
    reclaimer = RunReclaimer(client, runtime, acts.placement.live_runs)  # closed runs' files leave the node
    acts.placement.on_run_left = reclaimer.run_left
    stop = asyncio.Event()
    install_shutdown(stop)
    sweeps = asyncio.create_task(reclaimer.run_forever())
    try:
        with ThreadPoolExecutor(max_workers=16) as pool:
            node_worker = Worker(
                client, task_queue=runtime.task_queue, activities=acts.all(), activity_executor=pool,
                graceful_shutdown_timeout=timedelta(seconds=5),
                # node_liveness heartbeats must reach the server as often as they are sent
                # (by default the SDK holds them back for 80% of the heartbeat timeout)
                max_heartbeat_throttle_interval=LIVENESS_THROTTLE,
            )
            # claimed as a run's trainer node (agents that train) and as a rollout node (every agent)
            pools = [POOL_QUEUE, ROLLOUT_POOL_QUEUE] if trains else [ROLLOUT_POOL_QUEUE]
            pool_workers = [Worker(
                client, task_queue=q, activities=acts.pool(), activity_executor=pool,
                max_concurrent_activities=1, graceful_shutdown_timeout=timedelta(seconds=2),
            ) for q in pools]
            log.info("node %s boot %s (role %s) polling %s and %s", args.node_id, boot_id, args.role,
                     runtime.task_queue, ", ".join(pools))
            async with contextlib.AsyncExitStack() as workers:
                for w in [node_worker, *pool_workers]:
                    await workers.enter_async_context(w)
                await stop.wait()
    finally:
        weights.stop()
        sweeps.cancel()
        await reclaimer.close()
        await asyncio.to_thread(runtime.stop)
        log.info("node agent stopped")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: the trainer and the torch engines run on GPUs (float32; see docs/gpu.md)")
    p.add_argument("--trainer-gpu", type=int, default=0, help="--device cuda: the trainer's GPU index (default 0)")
    p.add_argument("--engine-gpus", default=None,
                   help="--device cuda: comma-separated GPU indices the engines cycle over "
                        "(default: the trainer's GPU, colocated)")
    p.add_argument("--node-id", default=socket.gethostname().split(".")[0])
    p.add_argument("--work-dir", default=None)
    p.add_argument("--engine-threads", type=int, default=1)
    p.add_argument("--trainer-threads", type=int, default=1)
    p.add_argument("--role", choices=["any", "rollout"], default="any",
                   help="any: this node may hold a run's trainer or its rollout engines; rollout: engines only "
                        "(claimed as one of a run's engines.nodes rollout nodes; no trainer process)")
    p.add_argument("--advertise-host", default="127.0.0.1",
                   help="the address other nodes reach this one on: its weight server binds it (rollout nodes "
                        "pull new versions from the trainer's node); a non-loopback one needs "
                        "$MILESTONE_ENGINE_TOKEN")
    p.add_argument("--weights-port", type=int, default=0, help="the weight server's port (default: a free one)")
    args = parse_worker_args(p, argv)
    try:
        check_exposure(args.advertise_host, engine_token(), "weight server (--advertise-host)")
    except ValueError as err:
        p.error(str(err))
    try:
        gpus = cuda_device_count() if args.device == "cuda" else 0
        args.placement = plan_placement(args.device, gpus, trainer_gpu=args.trainer_gpu,
                                        engine_gpus=parse_gpu_list(args.engine_gpus))
    except ValueError as err:
        p.error(str(err))
    metrics.serve(args.metrics_port, args.metrics_host)
    setup_logging(f"gpu[{args.node_id}]")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
