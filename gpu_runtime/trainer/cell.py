"""A sharded trainer cell: N ranks of one FSDP2 group, placed by Ray, driven by one process.

The driver (the trainer process) owns a local Ray instance (``RayRuntime``): it reserves
one bundle per rank in a placement group (``STRICT_PACK``: all ranks on one node), starts
one ``_Rank`` actor per bundle, and the ranks join a ``torch.distributed`` group over TCP
on 127.0.0.1 (gloo; NCCL when the cell trains on CUDA). Every driver call runs the same
method on all ranks at once (FSDP's collectives need every rank) and answers rank 0's
result. Ray is imported lazily: the ``cells`` extra is optional.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from gpu_runtime.store.artifacts import Sample
from gpu_runtime.trainer.api import TrainerHParams

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0  # a placement group not ready by then cannot be satisfied here


@dataclass
class RayRuntime:
    """A Ray instance started by this process (``ray.init``), stopped by ``stop``: ``ray.shutdown``
    and then a check, by pid, that every process Ray started is gone (never ``ray stop``)."""

    num_cpus: int
    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp")))
    pids: list[int] = field(default_factory=list)
    pid_file: Path | None = None  # where the pids are recorded, so a successor can end what a SIGKILL left
    _stopped: threading.Event = field(default_factory=threading.Event)
    _before: set[int] = field(default_factory=set)
    _owner: threading.Thread | None = None

    def start(self) -> "RayRuntime":
        """``ray.init`` on a thread of its own that lives until ``stop``: Ray starts GCS and
        raylet with PR_SET_PDEATHSIG, which kills them when the *thread* that started them
        ends, and the trainer serves each RPC connection on a short-lived thread."""
        if self.pid_file is not None:
            end_recorded(self.pid_file)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        self._before = {p.pid for p in psutil.Process().children(recursive=True)}
        started = threading.Event()
        failed: list[BaseException] = []

        def own() -> None:
            import ray

            try:
                ray.init(num_cpus=self.num_cpus, include_dashboard=False, _temp_dir=str(self.temp_dir),
                         _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False)
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                failed.append(err)
            started.set()
            if not failed:
                self._stopped.wait()

        self._stopped = threading.Event()
        self._owner = threading.Thread(target=own, name="ray-owner", daemon=True)
        self._owner.start()
        started.wait()
        if failed:
            raise failed[0]
        self.record()
        return self

    def record(self) -> None:
        """Note Ray's processes (this process's descendants it did not have before ``start``;
        its agents start a little later, so this is called again once a cell is up) and
        write them to ``pid_file``."""
        now = {p.pid for p in psutil.Process().children(recursive=True)} - self._before
        self.pids = sorted({*self.pids, *now})
        if self.pid_file is not None:
            rec = {}
            for pid in self.alive():
                try:
                    rec[str(pid)] = psutil.Process(pid).create_time()
                except psutil.NoSuchProcess:
                    pass
            self.pid_file.parent.mkdir(parents=True, exist_ok=True)
            self.pid_file.write_text(json.dumps({"pids": rec, "temp_dir": str(self.temp_dir)}))

    def alive(self) -> list[int]:
        out = []
        for pid in self.pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.NoSuchProcess:
                pass
        return out

    def stop(self, timeout_s: float = 20.0) -> None:
        import ray

        self.record()  # Ray's agents may have started after ``start`` looked
        ray.shutdown()
        self._stopped.set()
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.alive():  # what shutdown left behind: ours, by pid
            log.warning("ray process %d outlived ray.shutdown(): killing it", pid)
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        if self.pid_file is not None:
            self.pid_file.unlink(missing_ok=True)


def end_recorded(pid_file: Path) -> list[int]:
    """SIGKILL the Ray processes a killed predecessor recorded in ``pid_file`` (a SIGKILLed
    driver takes raylet and the workers with it, but Ray's per-node agents outlive it);
    a pid is only killed while its start time is the recorded one (no reused pid)."""
    if not pid_file.exists():
        return []
    rec = json.loads(pid_file.read_text())
    ended = []
    for pid, created in rec.get("pids", {}).items():
        try:
            p = psutil.Process(int(pid))
            if p.create_time() == created:
                p.kill()
                ended.append(int(pid))
        except psutil.NoSuchProcess:
            pass
    if ended:
        log.warning("ended Ray processes %s left by a previous trainer process", ended)
    temp_dir = str(rec.get("temp_dir", ""))
    if temp_dir.startswith("/tmp/ray-"):  # only a folder RayRuntime made
        shutil.rmtree(temp_dir, ignore_errors=True)
    pid_file.unlink(missing_ok=True)
    return ended


class CellRankDied(RuntimeError):
    """A rank's actor is gone (killed, crashed, its node lost): the cell is rebuilt by the next call."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Rank:
    """One rank's process (a Ray actor): joins the cell's group, then hosts a ``CellRankTrainer``."""

    def __init__(self, rank: int, world: int, port: int, threads: int) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)  # a fixed thread count: the step is bitwise reproducible
        torch.use_deterministic_algorithms(True)  # as the single trainer process
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        self.rank = rank
        self.trainer: Any = None

    def pid(self) -> int:
        return os.getpid()

    def peak_rss_mib(self) -> float:
        """This rank's peak resident memory (bench/bench_trainer_cell.py)."""
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def build(self, base_folder: str, hparams: TrainerHParams, seed: int) -> None:
        from gpu_runtime.trainer.cell_rank import CellRankTrainer

        self.trainer = CellRankTrainer.create_rank(base_folder, hparams, seed)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.trainer, method)(*args)

    def get(self, attr: str) -> Any:
        return getattr(self.trainer, attr)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerCell:
    """N FSDP2 ranks as Ray actors in one placement group; the calls ``TrainerService`` makes
    of a ``PolicyTrainer`` (train_step, save_state, load_state, checksum, export) on all ranks.
    ``ray.init`` must have run in this process (``RayRuntime``)."""

    def __init__(self, ranks: int, base_folder: str | Path, hparams: TrainerHParams, seed: int, *,
                 strategy: str = "STRICT_PACK", cpus_per_rank: float = 1.0, threads: int = 1,
                 placement_timeout_s: float = PLACEMENT_TIMEOUT_S) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if ranks < 1:
            raise ValueError(f"trainer.ranks_per_cell must be >= 1, got {ranks}")
        self.ranks = ranks
        self.pg = placement_group([{"CPU": cpus_per_rank}] * ranks, strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"the cell's placement group ({ranks} bundles of {cpus_per_rank} CPU, {strategy}) was not "
                f"satisfied within {placement_timeout_s:.0f} s: the Ray cluster has {ray.cluster_resources()}"
            ) from None
        self.dead = False  # a rank failed: the cell cannot take another step
        actor = ray.remote(_Rank)
        port = _free_port()
        self.actors = [
            actor.options(num_cpus=cpus_per_rank, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=i)).remote(i, ranks, port, threads)
            for i in range(ranks)
        ]
        self._all("build", str(base_folder), hparams, seed)

    def _all(self, method: str, *args: Any) -> list[Any]:
        """``method`` on every rank; the first rank that fails ends the wait (its peers may be
        blocked in a collective with it, and are killed when the cell is closed)."""
        import ray

        refs = [getattr(a, method).remote(*args) for a in self.actors]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
                self.dead = True
                raise CellRankDied(f"rank {refs.index(done[0])} of the cell died during {method}: {err}") from None
            except ray.exceptions.RayTaskError as err:
                self.dead = True  # a rank raised: its peers may wait in a collective forever
                raise err.as_instanceof_cause() from None
        return ray.get(refs)

    def _call(self, method: str, *args: Any) -> Any:
        return self._all("call", method, *args)[0]

    # ---- what the trainer service calls
    def train_step(self, samples: list[Sample], rewards: list[float], group_size: int,
                   hparams: TrainerHParams) -> dict[str, float]:
        return self._call("train_step", samples, rewards, group_size, hparams)

    def save_state(self, folder: str | Path) -> None:
        self._call("save_state", str(folder))

    def load_state(self, folder: str | Path) -> None:
        self._call("load_state", str(folder))

    def checksum(self) -> str:
        return str(self._call("checksum"))

    def published_state(self) -> dict:
        """The full weights (gathered on rank 0 and sent here)."""
        return self._call("published_state")

    def export_model_folder(self, folder: str | Path) -> str:
        return str(self._call("export_model_folder", str(folder)))

    @property
    def policy_version(self) -> int:
        import ray

        return int(ray.get(self.actors[0].get.remote("policy_version")))

    def pids(self) -> list[int]:
        return [int(p) for p in self._all("pid")]

    def close(self) -> None:
        """Leave the group, end the actors and free the placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            if not self.dead:
                self._all("close")
        except Exception as err:  # noqa: BLE001 - a dead rank: the actors are killed below anyway
            log.warning("closing the cell: %s", err)
        finally:
            for a in self.actors:
                ray.kill(a)
            remove_placement_group(self.pg)


__all__ = ["CellRankDied", "RayRuntime", "TrainerCell", "end_recorded"]
