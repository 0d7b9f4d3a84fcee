"""A fsdp2 cell on an existing Ray cluster (``trainer.ray_address`` / $MILESTONE_RAY_ADDRESS):
a real head (``ray start --head --block``, as ``make up`` starts it, stopped by pid in the
fixture). The trainer connects, places a 2-rank cell, trains, and on close ends only its own
placement group and actors: the head keeps running with all its CPUs free again."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import ray  # noqa: F401  (a dev dependency: imported, so a broken install fails loudly)

from gpu_runtime.trainer.fsdp2.errors import RayUnavailable
from gpu_runtime.trainer.fsdp2.ray_runtime import RayRuntime
from gpu_runtime.trainer.fsdp2.host import RAY_ADDRESS_ENV, CellHost
from gpu_runtime.trainer.protocol import Dead
from infra.ray_head import head_command, head_env, head_processes, stop_head, wait_ready
from gpu_runtime.proc.processes import pid_alive
from spec.trainer import TrainerSpec
from tests.stack import wait_for
from tests.unit.test_policy_trainer import hparams, rollout
from tests.unit.test_trainer_cell import post_sft_folder

SEED = 7
HP = hparams(micro_batch_size=2, ppo_epochs=1, kl_coef=0.0, warmup_steps=0, lr=1e-3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Head:
    """A Ray head of 2 CPUs on a fixed port (its own temp dir), started and stopped by pid."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.temp = Path(tempfile.mkdtemp(prefix="ray-head-", dir="/tmp"))
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        with open(self.temp / "head.log", "ab") as log:
            self.proc = subprocess.Popen(head_command(self.port, self.temp, 2), env={**os.environ, **head_env()},
                                         stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_ready(self.proc.pid, self.port)

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        stop_head(proc.pid)
        proc.wait(timeout=30)
        assert [p.pid for p in head_processes(proc.pid) if p.status() != psutil.STATUS_ZOMBIE] == []


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    h = Head()
    try:
        h.start()
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def folder() -> Path:
    return post_sft_folder(HP, 2, "cell-head-")


SETTINGS = TrainerSpec(backend="fsdp2", ranks_per_cell=2, placement="strict_pack", ray_address=None,
                                  collective_timeout_s=60, cells=1, cell_restart_backoff_s=5,
                                  cell_restart_backoff_max_s=300)


def test_a_cell_on_an_existing_head_leaves_it_running(head: Head, folder: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    head_pid, address = head.pid, head.address
    before = {p.pid for p in head_processes(head_pid)}
    monkeypatch.setenv(RAY_ADDRESS_ENV, address)  # the node's address (the run config leaves ray_address unset)
    host = CellHost(tmp_path)
    try:
        cell = host.build(SETTINGS, folder, HP, SEED)
        state = host.report()
        assert state is not None and state.ray_address == address
        ranks = [r.pid for r in state.ranks]
        assert set(ranks) <= {p.pid for p in head_processes(head_pid)}, "the ranks are the head's workers"
        assert [psutil.Process(p).nice() for p in ranks] == [0, 0], "the head starts its workers at niceness 0"
        m = cell.train_step(*rollout(1), 4, HP)
        assert m["policy_version"] == 1.0
        assert [e.kind for e in host.take_events()] == ["cell_started"]
    finally:
        host.close()
    assert not (tmp_path / "ray-pids.json").exists(), "nothing of an existing cluster is recorded as ours"
    wait_for(lambda: not any(pid_alive(p) for p in ranks), timeout_s=60, what="the cell's rank processes ended")
    assert pid_alive(head_pid)
    alive = {p.pid for p in head_processes(head_pid)}
    assert before - {*ranks} <= alive, f"head processes gone: {before - alive}"
    # the placement group and actors are gone: a new client sees all of the head's CPUs free
    rt = RayRuntime(num_cpus=0, address=address).start()
    try:
        import ray

        wait_for(lambda: ray.available_resources().get("CPU") == 2.0, timeout_s=60, what="the head's 2 CPUs free")
    finally:
        rt.stop()
    assert pid_alive(head_pid)


def test_a_head_restart_fails_the_call_clearly_and_the_next_one_reconnects(head: Head, folder: Path,
                                                                           tmp_path: Path) -> None:
    """The head stopped under a live cell (every actor goes with it): the next call fails at
    once with RayUnavailable naming the head (not a hang, not a rank's death), the host drops
    the cell and its connection (a ``ray_unavailable`` event); a build while the head is down
    fails at once too (``ray.init`` would wait minutes), and once the head is back on its
    address the next build reconnects and trains."""
    host = CellHost(tmp_path)
    settings = SETTINGS.model_copy(update={"ray_address": head.address})  # the run config's address this time
    try:
        cell = host.build(settings, folder, HP, SEED)
        cell.train_step(*rollout(1), 4, HP)
        head.stop()
        with pytest.raises(RayUnavailable, match=f"head \\(.*:{head.port}\\) is unreachable"):
            cell.train_step(*rollout(2), 4, HP)
        assert isinstance(cell.health, Dead) and cell.health.failure is not None
        host.failed(cell.health.failure)  # what the trainer service does with a failed call
        assert host.cell is None and host.ray is None
        assert [e.kind for e in host.take_events()] == ["cell_started", "ray_unavailable"]
        with pytest.raises(RayUnavailable, match="cannot reach the Ray head"):  # still down: at once, not a hang
            host.build(settings, folder, HP, SEED)
        head.start()
        again = host.build(settings, folder, HP, SEED)
        assert again.train_step(*rollout(1), 4, HP)["policy_version"] == 1.0
        assert host.report() is not None and host.report().generation == 2
    finally:
        host.close()
