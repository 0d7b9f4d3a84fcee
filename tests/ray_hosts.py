"""A Ray cluster across the hosts of the multi-host bed (tests/hosts.py), for fsdp2 cells whose
ranks sit on two machines (issue #29).

``start_ray_head(host)`` runs ``ray start --head --block`` on a bed host and
``start_ray_worker(host, head)`` a worker raylet on another that joins it. Each is started
through the host's ``spawn`` (so Ray's processes live in that host's network namespace and
private file view: its own /tmp, where Ray keeps its sockets and session files, and its own
/dev/shm, where the object store lives), on the host's bed address (``--node-ip-address``:
Ray registers each raylet at the address it is given, and the cell's rank 0 opens the group's
rendezvous there). Every Ray process of a node descends from the ``ray start --block`` pid;
``RayNode.stop`` ends them by pid (``infra.ray_head.stop_head``), never ``ray stop``,
which would end every Ray instance on the machine. A host's ``kill_all`` takes its Ray
processes with everything else (a lost machine).

What the cluster holds is read through the head's GCS by a short process on a bed host
(``ray_nodes``): the test process itself is outside the bed's network.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_runtime.proc.processes import pid_alive
from infra.ray_head import head_command, head_env, head_processes, stop_head, worker_command
from tests.hosts import ROOT, Host

RAY_PORT = 6379  # the head's GCS, on its host's bed address (each host has a port space of its own)
RAY_TEMP = Path("/tmp/ray")  # inside each host's private /tmp; short: Ray's unix sockets live under it
OBJECT_STORE_BYTES = 200 * 1024 * 1024  # the tiny model's state dicts are a few MiB; Ray's default is 30 % of RAM

# a process on a bed host that prints the cluster's nodes as the head's GCS knows them, as JSON
NODES_PROBE = """
import json, sys
from ray._raylet import GcsClient
from ray.core.generated.gcs_pb2 import GcsNodeInfo
infos = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=10)
print(json.dumps([{"ip": i.node_manager_address, "alive": i.state == GcsNodeInfo.GcsNodeState.ALIVE,
                   "head": i.is_head_node, "cpus": i.resources_total.get("CPU", 0.0)} for i in infos.values()]))
"""


@dataclass
class RayNode:
    """One Ray node (head or worker raylet) on a bed host: the ``ray start --block`` process."""

    host: Host
    proc: subprocess.Popen
    head: bool
    num_cpus: int

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def ip(self) -> str:
        return self.host.addr

    def stop(self, timeout_s: float = 20.0) -> list[int]:
        """End the node by pid: SIGTERM to ``ray start --block`` (it stops what it started),
        SIGKILL to whatever of it is left. The pids that had to be killed."""
        killed = stop_head(self.pid, timeout_s)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        left = [p.pid for p in head_processes(self.pid) if pid_alive(p.pid)]
        if left:
            raise RuntimeError(f"Ray node on {self.host.name}: processes {left} outlived SIGKILL")
        return killed


def ray_env() -> dict[str, str]:
    """The environment of a bed host's Ray processes: no auth token (the bed is its own
    network), workers at niceness 0 (``head_env``), and the repo importable (the cell's ranks
    are actors of ``gpu_runtime``, unpickled in the raylet's worker processes)."""
    return {**head_env(), "PYTHONPATH": str(ROOT)}


def start_ray_head(host: Host, num_cpus: int, port: int = RAY_PORT, timeout_s: float = 120.0) -> RayNode:
    """``ray start --head --block`` on ``host``'s bed address with ``num_cpus`` CPUs; returns
    once the head's GCS lists its own node alive."""
    cmd = [*head_command(port, RAY_TEMP, num_cpus, node_ip=host.addr),
           "--object-store-memory", str(OBJECT_STORE_BYTES)]
    node = RayNode(host, host.spawn("ray-head", cmd, env=ray_env()), head=True, num_cpus=num_cpus)
    try:
        wait_ray_nodes(host, f"{host.addr}:{port}", {host.addr}, proc=node.proc, timeout_s=timeout_s)
    except BaseException:
        node.stop()
        raise
    return node


def start_ray_worker(host: Host, head: RayNode, num_cpus: int, port: int = RAY_PORT,
                     timeout_s: float = 120.0) -> RayNode:
    """A worker raylet on ``host``'s bed address joining ``head`` with ``num_cpus`` CPUs;
    returns once the head's GCS lists it alive."""
    address = f"{head.ip}:{port}"
    cmd = [*worker_command(address, RAY_TEMP, num_cpus, node_ip=host.addr),
           "--object-store-memory", str(OBJECT_STORE_BYTES)]
    node = RayNode(host, host.spawn("ray-worker", cmd, env=ray_env()), head=False, num_cpus=num_cpus)
    try:
        wait_ray_nodes(head.host, address, {host.addr}, proc=node.proc, timeout_s=timeout_s)
    except BaseException:
        node.stop()
        raise
    return node


def ray_nodes(host: Host, address: str) -> list[dict]:
    """The nodes of the cluster whose head is ``address``, as its GCS lists them, read by a
    process on ``host``: ``[{"ip", "alive", "head", "cpus"}]`` (a dead node stays listed)."""
    done = host.run([sys.executable, "-c", NODES_PROBE, address], timeout_s=60, env=ray_env())
    if done.returncode != 0:
        raise RuntimeError(f"reading the Ray cluster at {address} from {host.name} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def alive_ips(host: Host, address: str) -> set[str]:
    """The bed addresses of the cluster's live nodes (empty while its GCS does not answer)."""
    try:
        return {n["ip"] for n in ray_nodes(host, address) if n["alive"]}
    except (RuntimeError, subprocess.TimeoutExpired):
        return set()


def wait_ray_nodes(host: Host, address: str, ips: set[str], *, proc: subprocess.Popen | None = None,
                   timeout_s: float = 120.0) -> None:
    """Until every address in ``ips`` is a live node of the cluster at ``address`` (read from
    ``host``); a ``proc`` (the node being started) that exits first is an error."""
    deadline = time.monotonic() + timeout_s
    while not ips <= alive_ips(host, address):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"ray start on {host.name} exited ({proc.returncode}) before {sorted(ips)} joined "
                               f"the cluster at {address}; see the bed's logs")
        if time.monotonic() > deadline:
            raise TimeoutError(f"Ray nodes {sorted(ips)} not alive in the cluster at {address} within {timeout_s:.0f} s")
        time.sleep(0.5)


def wait_ray_node_dead(host: Host, address: str, ip: str, timeout_s: float = 120.0) -> None:
    """Until the cluster at ``address`` (read from ``host``) no longer counts ``ip`` alive."""
    deadline = time.monotonic() + timeout_s
    while ip in alive_ips(host, address):
        if time.monotonic() > deadline:
            raise TimeoutError(f"Ray node {ip} still alive in the cluster at {address} after {timeout_s:.0f} s")
        time.sleep(0.5)


__all__ = ["RAY_PORT", "RayNode", "alive_ips", "ray_env", "ray_nodes", "start_ray_head", "start_ray_worker",
           "wait_ray_node_dead", "wait_ray_nodes"]
