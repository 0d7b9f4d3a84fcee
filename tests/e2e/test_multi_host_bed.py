"""The multi-host bed (tests/hosts.py) itself: hosts are isolated from one another and from
the root namespace, a whole RL run works across its hosts, and a run moves to another host
when the one holding it is lost (issue #29).

One bed for the module: a services host (Temporal, SeaweedFS, the control worker) and two
node hosts, each with a CPU node agent. The fault-free run of ``test_full_run_completes`` is
the bitwise twin of the run ``test_run_moves_to_the_other_host`` loses a host under.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors
from temporalio.client import Client

from gpu_runtime.proc.processes import pid_alive
from tests.e2e.faults import assert_bitwise_equal, assert_no_node_lost, progress, start_run
from tests.hosts import METRICS_PORT, ROOT, Bed, multi_host_bed_fixture  # noqa: F401  (fixture)
from tests.stack import async_wait_for, tiny_config, wait_for
from workflows.run_state import RunProgress, RunSummary

pytestmark = pytest.mark.e2e

STEPS = 4
BUCKET = f"bed-{uuid.uuid4().hex[:12]}"
ECHO_PORT = 7000
# a TCP server that answers each connection with the first line it reads
ECHO_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen()
while True:
    c, _ = s.accept()
    with c:
        c.sendall(c.makefile("rb").readline())
"""


def echo(addr: str, port: int, line: bytes, timeout_s: float = 3.0) -> bytes | None:
    """What ``addr:port`` answers to ``line``; None when it cannot be reached."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(line)
            return s.recv(len(line) + 100)
    except OSError:
        return None


@pytest.fixture(scope="module")
def bed(multi_host_bed: Callable[..., Bed]) -> Bed:
    return multi_host_bed(2)


def run_config(bed: Bed) -> dict:
    # tiny_config's store dir is replaced by the bed's S3 store
    return tiny_config(Path("/nonexistent"), steps=STEPS, store=bed.store_uri(BUCKET))


def final_weights(bed: Bed, summary: RunSummary) -> dict[str, torch.Tensor]:
    return load_safetensors(bed.store(BUCKET).get_bytes(f"{summary.final_weights_key}/model.safetensors"))


@dataclass(frozen=True)
class FinishedRun:
    summary: RunSummary
    progress: RunProgress
    weights: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def twin(bed: Bed) -> FinishedRun:
    """A fault-free run across the bed's hosts, finished."""

    async def main(client: Client) -> tuple[RunSummary, RunProgress]:
        handle = await start_run(client, "bed-twin", run_config(bed))
        summary = await asyncio.wait_for(handle.result(), 300)
        return summary, await progress(client, "bed-twin")

    summary, p = bed.call(main)
    return FinishedRun(summary, p, final_weights(bed, summary))


def test_hosts_are_isolated(bed: Bed) -> None:
    a, b = bed.nodes
    (a.dir / "mine").write_text("a")
    (b.dir / "mine").write_text("b")

    # files: a host sees its own dir (written from outside too), not the other's nor the bed's
    # logs; the repo stays visible
    seen = a.run(["sh", "-c", f"cat {a.dir}/mine; echo; ls {bed.root}; ls {bed.root}/hosts; "
                              f"test -e {b.dir} && echo sees-b; test -e {ROOT}/tests/hosts.py && echo sees-repo"])
    assert seen.returncode == 0, seen.stderr
    assert seen.stdout.split() == ["a", "hosts", a.name, "sees-repo"], seen.stdout

    # /dev/shm: one per host, shared by the host's processes, seen by no other host nor the root
    marker = f"bed-shm-{uuid.uuid4().hex[:8]}"
    assert a.run(["sh", "-c", f"echo {a.name} > /dev/shm/{marker}"]).returncode == 0
    assert a.run(["cat", f"/dev/shm/{marker}"]).stdout.strip() == a.name
    assert marker not in b.run(["ls", "-A", "/dev/shm"]).stdout.split()
    assert not Path(f"/dev/shm/{marker}").exists()

    # network: host a reaches host b's address; the root namespace has no interface on the
    # bed's subnet and does not reach b's server (a TCP connect alone proves nothing: a
    # transparent proxy on the default route may accept it, as on this machine)
    server = b.spawn("echo", [sys.executable, "-c", ECHO_SERVER, b.addr, str(ECHO_PORT)])
    line = f"hello {uuid.uuid4().hex}\n".encode()
    client = ("import socket, sys, time\n"
              "for _ in range(300):\n"
              "    try: s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2); break\n"
              "    except OSError: time.sleep(0.1)\n"
              "s.sendall(sys.argv[3].encode() + b'\\n'); sys.stdout.write(s.makefile().readline())")
    answer = a.run([sys.executable, "-c", client, b.addr, str(ECHO_PORT), line.decode().strip()])
    assert answer.stdout.encode() == line, answer.stderr
    assert bed.run(echo, b.addr, ECHO_PORT, line) == line  # the test's own thread inside the bed
    subnet = ipaddress.ip_network(f"{b.addr}/24", strict=False)
    root_addrs = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, check=True).stdout
    assert not [w for w in root_addrs.split() if "/" in w and ipaddress.ip_interface(w).ip in subnet], root_addrs
    assert echo(b.addr, ECHO_PORT, line) != line

    # Temporal answers inside the bed, not from the root namespace
    assert bed.call(lambda c: c.count_workflows()).count >= 0

    async def from_root() -> None:
        await asyncio.wait_for(Client.connect(bed.temporal_address), 10)

    with pytest.raises((RuntimeError, TimeoutError, OSError)):
        asyncio.run(from_root())

    b.procs.pop("echo")
    server.kill()
    server.wait(10)


# a run across the bed's hosts, and a colocated run moved off its lost host: long, as
# tests/e2e/test_multi_host.py covers both with rollout hosts in every `make test`
# (its rows 1 and 3); `make test-long` runs these
@pytest.mark.long
def test_full_run_completes(bed: Bed, twin: FinishedRun) -> None:
    """A whole run (SFT, 4 RL steps, checkpoints and the final eval) with its store on S3 on the
    services host and its trainer and engines on a node host."""
    assert twin.summary.steps == STEPS and twin.progress.state == "completed"
    assert twin.summary.data_cursor == STEPS * 4
    assert twin.progress.node_queue is not None
    host = bed.host_of_queue(twin.progress.node_queue)
    assert host in bed.nodes
    bed.call(lambda client: assert_no_node_lost(client, twin.summary.run_id))
    keys = bed.store(BUCKET).list("runs/bed-twin/checkpoints")
    assert any(k.endswith("manifest.json") for k in keys), keys
    assert (host.dir / "node").is_dir()


@pytest.mark.long
def test_run_moves_to_the_other_host(bed: Bed, twin: FinishedRun) -> None:
    """The host holding a run is lost (every process SIGKILLed) after step 1 committed: the
    run completes on the other host, bitwise equal to its fault-free twin; an agent started
    again on the lost host serves."""
    run_id = "bed-move"

    async def until_step_1(client: Client) -> RunProgress:
        await start_run(client, run_id, run_config(bed))

        async def committed() -> RunProgress | None:
            p = await progress(client, run_id)
            return p if p.step >= 1 and p.node_queue else None

        return await async_wait_for(committed, 300, interval_s=0.2, what="step 1 committed")

    before = bed.call(until_step_1)
    assert before.node_queue is not None
    lost = bed.host_of_queue(before.node_queue)
    children = bed.node_children(lost)
    assert children, bed.node_pids(lost)
    killed = lost.kill_all()
    assert set(children) <= set(killed) and not lost.pids()
    assert not [c for c in children if pid_alive(c)]

    async def to_end(client: Client) -> tuple[RunSummary, RunProgress]:
        summary = await asyncio.wait_for(client.get_workflow_handle(run_id, result_type=RunSummary).result(), 300)
        return summary, await progress(client, run_id)

    summary, p = bed.call(to_end)
    assert summary.steps == STEPS and p.node_queue is not None
    assert bed.host_of_queue(p.node_queue) is not lost
    assert any(e.kind == "node_lost" for e in p.events), [e.kind for e in p.events]
    assert_bitwise_equal(final_weights(bed, summary), twin.weights)

    # the lost host comes back: a new agent (fresh /dev/shm and /tmp) serves its metrics to the bed
    bed.start_node(lost)
    wait_for(lambda: bed.run(echo_metrics, lost.addr), 120, what=f"{lost.name}'s agent serving /metrics")


def echo_metrics(addr: str) -> bool:
    """Whether the node agent at ``addr`` answers /metrics."""
    import httpx

    try:
        return httpx.get(f"http://{addr}:{METRICS_PORT}/metrics", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
