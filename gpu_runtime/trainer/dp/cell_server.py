"""One DP cell's process: ``python -m gpu_runtime.trainer.dp.cell_server --index K
--lighthouse URL --work-dir D``. Prints ``READY port=<p> pid=<pid>`` once it serves the RPC
(``dp.cell_rpc``'s ``CELL_RPC``) its group (``gpu_runtime.trainer.dp.group``) calls; ``build``
creates the cell's trainer and ``join`` its torchft manager (``build`` does both unless told
not to: a restarted cell joins at the start of its first step). One call at a time."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import torch

from gpu_runtime.proc.processes import exit_when_parent_dies
from gpu_runtime.proc.rpc import RPCServer
from gpu_runtime.trainer.dp import cell_rpc
from gpu_runtime.trainer.dp.cell_rpc import BuildCall, CellReport, Empty, PathCall, StepInput, Text, TrainCall
from gpu_runtime.trainer.dp.cell_trainer import DPCellTrainer, new_manager
from spec.rpc import Handler

log = logging.getLogger(__name__)


class CellService:
    def __init__(self, index: int, lighthouse: str, timeout_s: float) -> None:
        self.index, self.lighthouse, self.timeout_s = index, lighthouse, timeout_s
        self.trainer: DPCellTrainer | None = None
        self.manager = None

    def _t(self) -> DPCellTrainer:
        if self.trainer is None:
            raise RuntimeError(f"cell {self.index}: not built")
        return self.trainer

    def report(self, **extra: object) -> CellReport:
        t = self._t()
        return CellReport(index=self.index, pid=os.getpid(), policy_version=t.policy_version,
                          state_checksum=t.state_checksum(), **extra)

    def build(self, a: BuildCall) -> CellReport:
        if self.trainer is not None:
            raise RuntimeError(f"cell {self.index}: already built (a cell is built once; the group restarts it)")
        self.trainer = DPCellTrainer.create(a.folder, a.hparams, a.seed)
        log.info("cell %d built (pid %d)", self.index, os.getpid())
        return self.join(Empty()) if a.join else self.report()

    def join(self, a: Empty) -> CellReport:
        """Create the cell's torchft manager (once). From then on it heartbeats the lighthouse,
        and a lighthouse that has no quorum yet (just restarted) will not form one of half
        or fewer of the cells it hears: a restarted cell must not heartbeat before the step it
        takes part in, or a step without it could not form a quorum."""
        if self.manager is None:
            self.manager = new_manager(self._t(), self.index, self.lighthouse, self.timeout_s)
        return self.report()

    def load_state(self, a: PathCall) -> CellReport:
        t = self._t()
        t.load_state(a.path)
        if self.manager is not None:
            t.sync_manager_step()
        return self.report()

    def train_step(self, a: TrainCall) -> CellReport:
        t0 = time.perf_counter()
        t = self._t()
        if self.manager is None:
            raise RuntimeError(f"cell {self.index}: train_step before join")
        step = StepInput.model_validate_json(open(a.input_path, "rb").read())
        t.forced_participants, t.from_version = a.forced_participants, a.from_version
        try:
            metrics = t.train_step(step.samples, step.rewards, step.group_size, step.hparams, step.temperature)
        finally:
            t.forced_participants, t.from_version = None, None
        return self.report(healed_from_step=t.healed_from_step, metrics=metrics, seconds=time.perf_counter() - t0)

    def save_state(self, a: PathCall) -> CellReport:
        self._t().save_state(a.path)
        return self.report()

    def export_model_folder(self, a: PathCall) -> Text:
        return Text(text=self._t().export_model_folder(a.path))

    def info(self, a: Empty) -> CellReport:
        return self.report()


def handlers(svc: CellService) -> list[Handler]:
    """One handler per method of ``cell_rpc.CELL_RPC``."""
    return [
        Handler(cell_rpc.BUILD, svc.build),
        Handler(cell_rpc.JOIN, svc.join),
        Handler(cell_rpc.LOAD_STATE, svc.load_state),
        Handler(cell_rpc.TRAIN_STEP, svc.train_step),
        Handler(cell_rpc.SAVE_STATE, svc.save_state),
        Handler(cell_rpc.EXPORT_MODEL_FOLDER, svc.export_model_folder),
        Handler(cell_rpc.INFO, svc.info),
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--timeout-s", type=float, default=120.0, help="cross-cell collectives and the commit vote")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--parent-pid", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s cell{args.index} %(levelname)s %(name)s %(message)s")
    if args.parent_pid:
        exit_when_parent_dies(args.parent_pid)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    svc = CellService(args.index, args.lighthouse, args.timeout_s)
    server = RPCServer("127.0.0.1", 0, cell_rpc.CELL_RPC.serve(*handlers(svc)))
    signal.signal(signal.SIGTERM, lambda s, f: os._exit(128 + s))  # torchft's threads would hold a clean exit
    server.announce_ready()
    server.serve_forever()


if __name__ == "__main__":
    main()
