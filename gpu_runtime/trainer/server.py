"""Trainer process: ``python -m gpu_runtime.trainer.server --work-dir D [--port 0]``.

Prints ``READY port=<p> pid=<pid>`` on stdout once it serves; everything else
goes to the log. One call at a time.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

import torch

from gpu_runtime.proc.devices import parse_gpu_list
from gpu_runtime.proc.disk import guarded
from gpu_runtime.proc.processes import exit_when_parent_dies
from gpu_runtime.proc.rpc import RPCServer
from gpu_runtime.store.object_store import LocalStore
from gpu_runtime.trainer.common.device import use_device
from gpu_runtime.trainer.service import TrainerService
from gpu_runtime.trainer.work_dir import remove_temp_dirs
from spec.rpc import Handler
from spec.trainer_rpc import (
    BROADCAST_WEIGHTS,
    CHECKPOINT,
    ENSURE_VERSION,
    FORGET_RUN,
    HELD_WEIGHTS,
    RESTART_CELLS,
    TRAIN_STEP,
    TRAINER_RPC,
)


def handlers(svc: TrainerService) -> list[Handler]:
    """One handler per method of ``TRAINER_RPC``, each a call of the service."""
    return [
        Handler(ENSURE_VERSION, lambda a: svc.ensure_version(a.setup, a.target)),
        Handler(TRAIN_STEP, lambda a: svc.train_step(a.setup, a.batch)),
        Handler(CHECKPOINT, lambda a: svc.checkpoint(a.setup, a.request)),
        Handler(RESTART_CELLS, lambda a: svc.restart_cells(a.setup, a.cells)),
        Handler(HELD_WEIGHTS, lambda a: svc.held_weights(a.run_id)),
        Handler(BROADCAST_WEIGHTS, svc.broadcast_weights),
        Handler(FORGET_RUN, lambda a: svc.forget_run(a.run_id)),
    ]


def build_methods(svc: TrainerService) -> dict[str, Handler]:
    """What the trainer's server serves: ``TRAINER_RPC``, whose typed client is ``TrainerProcess``.
    A write that fails for lack of space reaches the caller as ``DiskFull`` (``gpu_runtime.proc.disk``)."""
    return TRAINER_RPC.serve(*(Handler(h.method, guarded(h.fn, lambda: write_paths(svc))) for h in handlers(svc)))


def write_paths(svc: TrainerService) -> list[Path]:
    """Where the trainer writes: its work dir and, with a file:// store, the store."""
    inner = svc.store.inner if svc.store is not None else None
    return [svc.work_dir, *([inner.root] if isinstance(inner, LocalStore) else [])]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--work-dir", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (fixed for bitwise replay)")
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the policy trains (float32 weights)")
    p.add_argument("--cell-gpus", default=None,
                   help="--device cuda: the GPUs a fsdp2 cell's ranks may take, e.g. 0,2,3 (default: all)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s trainer %(levelname)s %(message)s")
    if args.parent_pid:
        exit_when_parent_dies(args.parent_pid)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    use_device(args.device)
    remove_temp_dirs(Path(args.work_dir))  # a killed predecessor's half-written saves and restores
    svc = TrainerService(args.work_dir, cell_gpus=tuple(parse_gpu_list(args.cell_gpus, "--cell-gpus") or ()))
    server = RPCServer(args.host, args.port, build_methods(svc))
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so a stop ends a fsdp2 cell's Ray processes
    server.announce_ready()
    try:
        server.serve_forever()
    finally:
        svc.close()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
