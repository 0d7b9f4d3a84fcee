"""The trainer process's connection to Ray for a fsdp2 cell (``RayRuntime``): a Ray
instance it starts and stops itself (its processes ended by pid, never ``ray stop``), or
an existing cluster it only connects to. Ray is imported lazily: the ``cells`` extra is
optional."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from gpu_runtime.proc.processes import reachable
from gpu_runtime.trainer.fsdp2.errors import RayUnavailable

# Ray starts its workers at niceness 15 (its raylet config ``worker_niceness``) unless told
# otherwise: a cell's ranks then got a few percent of a CPU that nice-0 processes (engines,
# the node's other processes) also wanted, and a rank took minutes to start (the cell's
# 60 s rendezvous ran out in CI). The trainer is the job, so its workers run at 0 (Ray's own
# job submission does the same). Read by the raylet at its start: ours, or ``make up``'s head.
RAY_WORKER_ENV = {"RAY_worker_niceness": "0"}

log = logging.getLogger(__name__)


@contextmanager
def visible_gpus(ids: tuple[int, ...]) -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES`` set to ``ids`` (nothing changed when empty) while Ray starts:
    its raylet inherits the variable and hands actors only those GPUs (each actor's own
    ``CUDA_VISIBLE_DEVICES`` then names its physical GPU). ``ids`` count as torch does here:
    under an outer ``CUDA_VISIBLE_DEVICES`` they index its list. Restored after: the trainer
    process's own CUDA context was made at its start."""
    if not ids:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    outer = [v.strip() for v in before.split(",") if v.strip()] if before else None
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(outer[i] if outer else str(i) for i in ids)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


@dataclass
class RayRuntime:
    """This process's connection to Ray. Without ``address``: a Ray instance started here
    (``ray.init``), stopped by ``stop`` with ``ray.shutdown`` and then a check, by pid, that
    every process Ray started is gone (never ``ray stop``). With ``address``: an existing
    cluster this process only connects to; ``stop`` disconnects and leaves it running."""

    num_cpus: int
    address: str | None = None  # an existing cluster (``trainer.ray_address`` / $MILESTONE_RAY_ADDRESS)
    gpu_ids: tuple[int, ...] = ()  # started here: the GPUs Ray may assign (empty: what the process sees)
    temp_dir: Path | None = None
    pids: list[int] = field(default_factory=list)
    pid_file: Path | None = None  # where the pids are recorded, so a successor can end what a SIGKILL left
    _stopped: threading.Event = field(default_factory=threading.Event)
    _before: set[int] = field(default_factory=set)
    _owner: threading.Thread | None = None

    def start(self) -> RayRuntime:
        """``ray.init`` on a thread of its own that lives until ``stop``: Ray starts GCS and
        raylet with PR_SET_PDEATHSIG, which kills them when the *thread* that started them
        ends, and the trainer serves each RPC connection on a short-lived thread."""
        if self.pid_file is not None and self.address is None:
            end_recorded(self.pid_file)
        if self.address is not None and ":" in self.address and "://" not in self.address \
                and not reachable(self.address):  # ray.init would wait for a dead head for minutes
            raise RayUnavailable(f"cannot reach the Ray head at {self.address} (trainer.ray_address / "
                                 "$MILESTONE_RAY_ADDRESS): is it running?")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        for k, v in RAY_WORKER_ENV.items():
            os.environ.setdefault(k, v)
        if self.address is None and self.temp_dir is None:
            self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        self._before = {p.pid for p in psutil.Process().children(recursive=True)}
        started = threading.Event()
        failed: list[BaseException] = []

        def own() -> None:
            import ray

            try:
                if self.address is not None:
                    ray.init(address=self.address, log_to_driver=False, configure_logging=False)
                else:
                    with visible_gpus(self.gpu_ids):
                        ray.init(num_cpus=self.num_cpus, include_dashboard=False, _temp_dir=str(self.temp_dir),
                                 _node_ip_address="127.0.0.1", log_to_driver=False, configure_logging=False,
                                 num_gpus=len(self.gpu_ids) if self.gpu_ids else None)  # None: Ray's default
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
            if self.address is not None:
                raise RayUnavailable(f"cannot connect to the Ray cluster at {self.address}: {failed[0]}") from failed[0]
            raise failed[0]
        self.record()
        return self

    def record(self) -> None:
        """Note Ray's processes (this process's descendants it did not have before ``start``;
        its agents start a little later, so this is called again once a cell is up) and
        write them to ``pid_file``. Connected to an existing cluster: nothing is ours."""
        if self.address is not None:
            return
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
        try:
            ray.shutdown()
        except Exception as err:  # noqa: BLE001 - a lost cluster: nothing left to disconnect from
            log.warning("ray.shutdown: %s", err)
        self._stopped.set()
        if self.address is not None:  # an existing cluster: it keeps running, none of its processes is ours
            return
        deadline = time.monotonic() + timeout_s
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        for pid in self.alive():  # what shutdown left behind: ours, by pid
            log.warning("ray process %d outlived ray.shutdown(): killing it", pid)
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        if self.temp_dir is not None:
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


__all__ = ["RayRuntime", "end_recorded", "visible_gpus"]
