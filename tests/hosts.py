"""The multi-host test bed: N "hosts" on one Linux machine, each a network namespace with an
address of its own and a private view of the files, on a bridge that carries all their traffic
and nothing else (issue #29: a run that spans machines).

What a ``Bed`` makes (root only; ``namespaces_unavailable`` says why not):

- a switch namespace ``<tag>-sw`` holding a bridge; each host namespace ``<tag>-<host>``
  gets a veth pair made directly inside the two namespaces (``eth0`` in the host, ``p<i>`` on
  the bridge): nothing is added to the root namespace, so no bed traffic leaves the bed.
  Addresses ``10.<a>.<b>.<i+1>/24`` (host ``i``); ``lo`` is up everywhere and each host's
  127.0.0.1 is its own. ``<tag>`` is ``mhb-<pid>-<random>``, so two pytest-xdist workers
  make beds side by side (each has its own switch: address reuse across beds is harmless).
- one mount namespace per host, held by a keeper process (``sleep infinity``): a fresh
  tmpfs on ``/dev/shm`` (shared-memory weight segments never cross hosts) and on ``/tmp``
  (or the bed's root where that is not under /tmp) holding only the host's own dir, bound
  back at its real path: a host sees its own work dir and not the others', the bed's logs
  or anything else the bed keeps. The repo and the venv stay visible. Every process of the
  host enters the keeper's namespaces (``nsenter``), so a host's processes share its
  /dev/shm and /tmp as on one machine; ``kill_all`` takes the keeper too, and the next
  process starts a fresh one (a lost host comes back with empty tmpfs, like a reboot).
- a services host running the Temporal dev server (on 0.0.0.0 in its namespace), SeaweedFS
  (S3) and the control worker; a node agent (``python -m workers.gpu --device cpu``) per
  node host.
- a thread of this process that entered the services namespace (``NamespaceThread``): the
  test talks to Temporal (``Bed.call``) and S3 (``Bed.store``, ``Bed.run``) from there, as
  the root namespace has no route into the bed.

Every process is started by pid in its own session, and ``Bed.stop`` kills every process in
every namespace of the bed by pid, deletes the namespaces (their veths and bridge go with
them) and the host dirs, also when the test failed (fixture ``finally``, ``atexit``, and a
sweep of beds whose pytest process died: ``sweep_stale_beds``).
"""

from __future__ import annotations

import asyncio
import atexit
import ctypes
import functools
import gc
import os
import random
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, TypeVar

import pytest
from temporalio.client import Client
from temporalio.runtime import Runtime, TelemetryConfig

from gpu_runtime.engine.auth import ENGINE_TOKEN_ENV
from gpu_runtime.node.children_file import left_behind, read_children
from gpu_runtime.proc.processes import pid_alive, spawn
from gpu_runtime.store.s3 import S3Store
from infra.seaweedfs import SeaweedServer
from infra.temporal_server import server_command
from workers.temporal_connection import data_converter

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")

PREFIX = "mhb"  # every namespace of a bed is named mhb-<pid>-<hex>-<host>
CLONE_NEWNET = 0x40000000
SERVICES = "services"
TEMPORAL_PORT, TEMPORAL_HTTP_PORT, TEMPORAL_METRICS_PORT = 7233, 7243, 7235
S3_PORT = 8333
# SeaweedFS's other ports, fixed below the ephemeral range (32768+) so they never meet the
# Temporal dev server's own free ports in the services namespace; the admin worker dials admin + 10000
SEAWEED_PORTS = {"master": 9333, "master_grpc": 19333, "volume": 8080, "volume_grpc": 18080, "filer": 8888,
                 "filer_grpc": 18888, "s3_grpc": 18333, "admin": 21000}
METRICS_PORT = 9100  # each node agent's /metrics, on 0.0.0.0 in its host
ACCESS_KEY = "MSBEDAKID7C1E9F3B2"
SECRET_KEY = "ms-bed-secret-5e0a7d2c91f4"


# -- what the machine allows --------------------------------------------------------------


def namespaces_unavailable() -> str | None:
    """Why this machine cannot make a bed (not root, a missing tool, a kernel that refuses a
    network or mount namespace), or None."""
    if os.geteuid() != 0:
        return f"the multi-host bed needs root (network namespaces, mounts); this process runs as uid {os.geteuid()}"
    for tool in ("ip", "unshare", "nsenter", "sleep"):
        if shutil.which(tool) is None:
            return f"the multi-host bed needs `{tool}` on PATH (iproute2, util-linux, coreutils)"
    probe = f"{PREFIX}-probe-{os.getpid()}-{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        view = subprocess.run(["ip", "netns", "exec", probe, "unshare", "-m", "--propagation", "private",
                               "sh", "-c", "mount -t tmpfs probe /dev/shm"], capture_output=True, text=True)
        if view.returncode != 0:
            return f"a private mount namespace with a tmpfs failed: {view.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def require_namespaces() -> None:
    """Fail (with ``CI`` set) or skip, saying why, where a bed cannot be made: never silently."""
    reason = namespaces_unavailable()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"multi-host bed unavailable on CI: {reason}")
    pytest.skip(f"multi-host bed unavailable: {reason}")


# -- namespaces ---------------------------------------------------------------------------


def ip(*args: str) -> str:
    """``ip ARGS``; its stdout. Raises with ip's stderr on failure."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def netns_pids(ns: str) -> list[int]:
    """The processes whose (main thread's) network namespace is ``ns``, as ``ip netns pids``
    finds them, without this process (a thread of it may have entered ``ns``)."""
    try:
        target = os.stat(f"/run/netns/{ns}")
    except FileNotFoundError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            st = os.stat(f"/proc/{entry}/ns/net")
        except OSError:  # gone, or a zombie
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino) and pid_alive(int(entry)):
            pids.append(int(entry))
    return pids


def kill_namespace(ns: str, sig: int = signal.SIGKILL, timeout_s: float = 30.0) -> list[int]:
    """Send ``sig`` to every process in ``ns``, by pid; after SIGKILL, wait until none is
    left (processes forked meanwhile are killed too). The pids signalled first."""
    first = netns_pids(ns)
    pids = list(first)
    deadline = time.monotonic() + timeout_s
    while pids:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if sig != signal.SIGKILL:
            break
        time.sleep(0.05)
        pids = netns_pids(ns)
        if pids and time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} in namespace {ns} outlived SIGKILL for {timeout_s}s")
    return first


def sweep_stale_beds() -> list[str]:
    """Delete the namespaces of beds whose pytest process is gone (SIGKILLed before its
    teardown ran), killing what still runs in them. The namespaces deleted."""
    swept = []
    for line in ip("netns", "list").splitlines():
        name = line.split(" ", 1)[0]
        parts = name.split("-")
        if len(parts) < 4 or parts[0] != PREFIX or not parts[1].isdigit() or pid_alive(int(parts[1])):
            continue
        kill_namespace(name)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        swept.append(name)
    return swept


def enter_netns(ns: str) -> None:
    """Move the calling thread (only it: ``setns`` acts per thread) into network namespace
    ``ns``. Sockets it opens afterwards, and threads it starts, live there."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


class NamespaceThread:
    """An asyncio loop on a thread of this process that entered a network namespace, with a
    Temporal client connected from there. Its default executor's threads are started by the
    loop's thread, so they are in the namespace too (``run``).

    The client gets a Temporal ``Runtime`` of its own made on this thread: the SDK's network
    threads (tokio's) start with the runtime and inherit the namespace of the thread that
    made it; the process-wide default runtime's threads may have started in the root one."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._runtime: Runtime | None = None
        self._client: Client | None = None
        self._thread = threading.Thread(target=self._main, name=f"netns-{ns}", daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._error is not None:
            raise self._error

    def _main(self) -> None:
        try:
            enter_netns(self.ns)
        except OSError as err:
            self._error = err
            self._started.set()
            return
        asyncio.set_event_loop(self._loop)
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            # the client and its runtime go now: the runtime's threads hold the namespace
            self._client = None
            self._runtime = None
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.close()
            gc.collect()

    def submit(self, coro: Awaitable[T], timeout_s: float = 600.0) -> T:
        """Run ``coro`` on the namespace's loop; its result (``timeout_s``: TimeoutError)."""
        async def wrapped() -> T:
            return await coro

        future = asyncio.run_coroutine_threadsafe(wrapped(), self._loop)
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            future.cancel()
            raise TimeoutError(f"no result from namespace {self.ns} within {timeout_s}s") from None

    def run(self, fn: Callable[..., T], *args: Any, timeout_s: float = 600.0) -> T:
        """Call the blocking ``fn(*args)`` on a thread in the namespace."""
        return self.submit(asyncio.to_thread(fn, *args), timeout_s)

    async def client(self, address: str) -> Client:
        """The Temporal client (pydantic converter) of ``address``, connected once, on this loop."""
        if self._client is None:
            if self._runtime is None:
                self._runtime = Runtime(telemetry=TelemetryConfig())
            self._client = await Client.connect(address, data_converter=data_converter(), runtime=self._runtime)
        return self._client

    def close(self) -> None:
        """Stop the loop and end the thread: the namespace is no longer held by this process."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)


# -- hosts --------------------------------------------------------------------------------


class Host:
    """One host of a bed: network namespace ``ns`` with address ``addr``, work dir ``dir``
    (the only dir of the bed it sees), and the processes started on it."""

    def __init__(self, name: str, ns: str, addr: str, work_dir: Path, bed_root: Path, logs: Path) -> None:
        self.name = name
        self.ns = ns
        self.addr = addr
        self.dir = work_dir
        self.bed_root = bed_root
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}
        self._keeper: subprocess.Popen | None = None

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.addr}, ns={self.ns})"

    # the host's view of the files

    def view_script(self) -> str:
        """The shell lines (run in a fresh private mount namespace) that make the host's view:
        tmpfs on /dev/shm and /tmp, and a tmpfs over the bed's root (or /tmp, where the bed
        lives under it) holding only this host's dir, bound back at its own path. The new
        view is built on a stage (``<bed root>/stage/<host>``) and moved over the top at once."""
        tmp = Path("/tmp").resolve()
        top = tmp if self.bed_root.is_relative_to(tmp) else self.bed_root
        # the repo, the venv and the interpreter stay visible: bound back where the tmpfs hides them
        # (a checkout under /tmp, say); the innermost of nested ones is covered by the outer
        needed = sorted({p for p in (ROOT, Path(sys.prefix).resolve(), Path(sys.executable).resolve().parent)
                         if p.is_relative_to(top)})
        shown = [p for p in needed if not any(p != q and p.is_relative_to(q) for q in needed)]
        for path in shown:
            if self.bed_root.is_relative_to(path):
                raise ValueError(f"bed root {self.bed_root} lies inside {path}, which every host must see")
        stage = self.bed_root / "stage" / self.name
        stage.mkdir(parents=True, exist_ok=True)
        inner = stage / self.dir.relative_to(top)
        q = shlex.quote
        lines = ["set -e", f"mount -t tmpfs -o mode=1777 {self.ns}-shm /dev/shm"]
        if top != tmp:
            lines.append(f"mount -t tmpfs -o mode=1777 {self.ns}-tmp /tmp")
        lines += [
            f"mount -t tmpfs -o mode=755 {self.ns}-view {q(str(stage))}",
            f"mkdir -p {q(str(inner))}",
            f"mount --bind {q(str(self.dir))} {q(str(inner))}",
        ]
        for path in shown:
            lines += [f"mkdir -p {q(str(stage / path.relative_to(top)))}",
                      f"mount --rbind {q(str(path))} {q(str(stage / path.relative_to(top)))}"]
        lines.append(f"mount --move {q(str(stage))} {q(str(top))}")
        if top == tmp:
            lines.append("chmod 1777 /tmp")
        return "\n".join([*lines, "exec sleep infinity"])

    def keeper(self) -> int:
        """The pid of the process holding the host's mount namespace; started (and waited
        for until its view is made) when there is none."""
        if self._keeper is not None and self._keeper.poll() is None and pid_alive(self._keeper.pid):
            return self._keeper.pid
        cmd = ["ip", "netns", "exec", self.ns, "unshare", "-m", "--propagation", "private", "sh", "-c", self.view_script()]
        proc = spawn(cmd, self.logs / f"{self.name}-keeper.log")
        deadline = time.monotonic() + 30
        while _comm(proc.pid) != "sleep":
            if proc.poll() is not None or time.monotonic() > deadline:
                log = (self.logs / f"{self.name}-keeper.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"host {self.name}: its file view was not made (exit {proc.poll()}): {log}")
            time.sleep(0.02)
        self._keeper = proc
        return proc.pid

    def command(self, cmd: list[str], cwd: Path = ROOT) -> list[str]:
        """``cmd`` as run on this host: in its network and mount namespaces, in ``cwd``."""
        return ["nsenter", f"--target={self.keeper()}", "--mount", "--net", f"--wd={cwd}", "--", *cmd]

    def spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.Popen:
        """Start ``cmd`` on this host in its own session, logging to ``<bed>/logs/<host>-<name>.log``
        (outside every host's view); its pid is the command's own (nsenter execs it)."""
        proc = spawn(self.command(cmd, cwd), self.logs / f"{self.name}-{name}.log", env=env)
        self.procs[name] = proc
        return proc

    def run(self, cmd: list[str], timeout_s: float = 60.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` on this host to its end; its output as text."""
        return subprocess.run(self.command(cmd), capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **(env or {})})

    # faults

    def pids(self) -> list[int]:
        """Every process in the host's network namespace (its keeper included)."""
        return netns_pids(self.ns)

    def kill_all(self, sig: int = signal.SIGKILL) -> list[int]:
        """``sig`` to every process of the host, by pid (SIGKILL: the host is lost, and this
        returns once none is left). The pids signalled."""
        if sig == signal.SIGKILL:
            kill_namespace(self.ns, signal.SIGCONT)  # a stopped process dies on SIGKILL anyway; no harm
        pids = kill_namespace(self.ns, sig)
        if sig == signal.SIGKILL:
            self._reap()
        return pids

    def stop_all(self) -> list[int]:
        """SIGSTOP every process of the host: it is partitioned (alive, silent)."""
        return self.kill_all(signal.SIGSTOP)

    def cont_all(self) -> list[int]:
        """SIGCONT every process of the host: the partition heals."""
        return self.kill_all(signal.SIGCONT)

    def _reap(self) -> None:
        for proc in [*self.procs.values(), *([self._keeper] if self._keeper else [])]:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


@functools.cache
def gpu_help() -> str:
    """``python -m workers.gpu --help`` of this tree (read once): which flags its node agent takes."""
    done = subprocess.run([sys.executable, "-m", "workers.gpu", "--help"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"python -m workers.gpu --help failed: {done.stderr[-2000:]}")
    return done.stdout


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# -- the bed ------------------------------------------------------------------------------


class BedStore:
    """An ``S3Store`` of the bed's SeaweedFS whose calls run on the bed's namespace thread
    (the only place in this process that reaches it)."""

    def __init__(self, bed: Bed, store: S3Store) -> None:
        self.bed = bed
        self.store = store

    def get_bytes(self, key: str) -> bytes:
        return self.bed.run(self.store.get_bytes, key)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.bed.run(self.store.put_bytes, key, data)

    def exists(self, key: str) -> bool:
        return self.bed.run(self.store.exists, key)

    def list(self, prefix: str) -> list[str]:
        return self.bed.run(self.store.list, prefix)

    def delete_prefix(self, prefix: str) -> None:
        self.bed.run(self.store.delete_prefix, prefix)


_LIVE: set[Bed] = set()


@atexit.register
def _stop_live_beds() -> None:
    for bed in list(_LIVE):
        try:
            bed.stop()
        except Exception as err:  # noqa: BLE001 - the others must still go
            print(f"multi-host bed {bed.tag}: cleanup at exit failed: {err}", file=sys.stderr)


class Bed:
    """``n_nodes`` node hosts (``node0``...) and, with ``services``, a services host (Temporal,
    SeaweedFS, the control worker) on one bridge under ``root``. ``env``: more environment
    for every worker process (fault-injection knobs, ...). Use as a context manager, or
    ``start()`` / ``stop()``."""

    def __init__(self, root: Path, n_nodes: int = 3, *, services: bool = True, env: dict[str, str] | None = None) -> None:
        if not 1 <= n_nodes <= 200:
            raise ValueError(f"n_nodes: 1..200 node hosts, got {n_nodes}")
        self.root = root.resolve()
        self.tag = f"{PREFIX}-{os.getpid()}-{secrets.token_hex(2)}"
        self.subnet = f"10.{random.randint(200, 250)}.{random.randint(0, 255)}"
        self.extra_env = dict(env or {})
        # the engines', router's and weight server's bearer token: a node that serves on its
        # bed address (``--advertise-host``) refuses to start without one
        self.engine_token = secrets.token_hex(16)
        self.logs = self.root / "logs"
        names = ([SERVICES] if services else []) + [f"node{i}" for i in range(n_nodes)]
        self.hosts: dict[str, Host] = {
            name: Host(name, f"{self.tag}-{name}", f"{self.subnet}.{i + 1}", self.root / "hosts" / name, self.root, self.logs)
            for i, name in enumerate(names)
        }
        self.switch_ns = f"{self.tag}-sw"
        self.seaweed: SeaweedServer | None = None
        self._thread: NamespaceThread | None = None

    # -- the hosts

    @property
    def services(self) -> Host:
        if SERVICES not in self.hosts:
            raise RuntimeError("this bed has no services host (Bed(services=False))")
        return self.hosts[SERVICES]

    @property
    def nodes(self) -> list[Host]:
        return [h for name, h in self.hosts.items() if name != SERVICES]

    def host(self, host: Host | str) -> Host:
        return host if isinstance(host, Host) else self.hosts[host]

    def host_of_queue(self, node_queue: str) -> Host:
        """The host whose node agent listens on ``node_queue`` (``node-<node id>-<boot id>``)."""
        return self.hosts[node_queue.split("-")[1]]

    # -- lifecycle

    def start(self, agents: bool = True) -> Bed:
        """Make the network and every host's view; with a services host, start Temporal,
        SeaweedFS and the control worker; with ``agents``, a node agent on every node host."""
        _LIVE.add(self)
        sweep_stale_beds()
        self._make_network()
        for host in self.hosts.values():
            host.dir.mkdir(parents=True, exist_ok=True)
            host.keeper()
        if SERVICES in self.hosts:
            self._thread = NamespaceThread(self.services.ns)
            self._start_services()
        if agents:
            for host in self.nodes:
                self.start_node(host)
        return self

    def _make_network(self) -> None:
        sw = self.switch_ns
        ip("netns", "add", sw)
        ip("-n", sw, "link", "add", "br0", "type", "bridge")
        ip("-n", sw, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts.values()):
            ip("netns", "add", host.ns)
            ip("link", "add", "eth0", "netns", host.ns, "type", "veth", "peer", "name", f"p{i}", "netns", sw)
            ip("-n", sw, "link", "set", f"p{i}", "master", "br0")
            ip("-n", sw, "link", "set", f"p{i}", "up")
            ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            ip("-n", host.ns, "link", "set", "eth0", "up")
            ip("-n", host.ns, "link", "set", "lo", "up")

    def _start_services(self) -> None:
        services = self.services
        self.seaweed = SeaweedServer(services.dir / "seaweedfs", S3_PORT, ACCESS_KEY, SECRET_KEY, bind="0.0.0.0")
        self.seaweed.ports = dict(SEAWEED_PORTS)
        (services.dir / "seaweedfs" / "logs").mkdir(parents=True, exist_ok=True)
        weed = services.spawn("seaweedfs", self.seaweed.command(), cwd=self.seaweed.data_dir,
                              env={"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY})
        temporal = services.spawn("temporal", server_command(
            services.dir / "temporal.db", TEMPORAL_PORT, None, http_port=TEMPORAL_HTTP_PORT,
            metrics_port=TEMPORAL_METRICS_PORT, ip="0.0.0.0"))
        self._wait_serving("SeaweedFS S3", weed, self._s3_answers)
        self._wait_serving("Temporal", temporal, self._temporal_answers)
        self.start_control()

    def _wait_serving(self, what: str, proc: subprocess.Popen, answers: Callable[[], Awaitable[bool]],
                      timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.submit(answers(), 30):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} on the services host did not serve (exit {proc.poll()}); "
                                   f"see {self.logs}: {self.log_tail(proc)}")
            time.sleep(0.2)

    async def _temporal_answers(self) -> bool:
        try:
            client = await self._ns_thread().client(self.temporal_address)
            await client.count_workflows()
            return True
        except RuntimeError:  # "connection refused", "Frontend is not healthy yet"
            return False

    async def _s3_answers(self) -> bool:
        def list_buckets() -> bool:
            import boto3
            from botocore.config import Config

            try:
                boto3.session.Session().client(
                    "s3", endpoint_url=self.s3_endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                    region_name="us-east-1", config=Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}),
                ).list_buckets()
                return True
            except Exception:  # noqa: BLE001 - any failure means "not ready yet"
                return False

        return await asyncio.to_thread(list_buckets)

    def stop(self) -> None:
        """Kill every process of every host by pid, end the namespace thread, delete every
        namespace (veths and bridge with them) and the host dirs; the logs stay under the
        bed's root. Safe to call twice; raises, after doing all it can, if anything stayed."""
        errors: list[str] = []
        for host in self.hosts.values():
            try:
                host.kill_all(signal.SIGKILL)
            except Exception as err:  # noqa: BLE001 - the other hosts must still go
                errors.append(f"{host.name}: {err}")
        if self._thread is not None:
            self._thread.close()
            self._thread = None
        for ns in [*(h.ns for h in self.hosts.values()), self.switch_ns]:
            if Path(f"/run/netns/{ns}").exists():
                done = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
                if done.returncode != 0:
                    errors.append(f"ip netns del {ns}: {done.stderr.strip()}")
        for sub in ("hosts", "stage"):
            shutil.rmtree(self.root / sub, ignore_errors=True)
        _LIVE.discard(self)
        if errors:
            raise RuntimeError(f"multi-host bed {self.tag} cleanup: {'; '.join(errors)}")

    def __enter__(self) -> Bed:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- addresses, environment

    @property
    def temporal_address(self) -> str:
        return f"{self.services.addr}:{TEMPORAL_PORT}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{self.services.addr}:{S3_PORT}"

    @property
    def worker_env(self) -> dict[str, str]:
        """The environment of every worker process: Temporal and S3 on the services host, the
        bed's engine token."""
        return {
            "MILESTONE_TEMPORAL_ADDRESS": self.temporal_address, "MILESTONE_S3_ENDPOINT": self.s3_endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "PYTHONPATH": str(ROOT),
            ENGINE_TOKEN_ENV: self.engine_token, **self.extra_env,
        }

    def store_uri(self, bucket: str, prefix: str = "bed") -> str:
        """A run's ``store``: ``s3://<bucket>/<prefix>`` on the bed's SeaweedFS (workers read the
        endpoint and keys from ``worker_env``). The run's keys are ``runs/<run id>/...`` under it."""
        return f"s3://{bucket}/{prefix}"

    def store(self, bucket: str, prefix: str = "bed") -> BedStore:
        """The store of ``store_uri(bucket, prefix)``, read from this process (bucket made if missing)."""
        return BedStore(self, self.run(lambda: S3Store(bucket, prefix, endpoint_url=self.s3_endpoint,
                                                       access_key=ACCESS_KEY, secret_key=SECRET_KEY)))

    # -- processes

    def start_control(self) -> subprocess.Popen:
        return self.services.spawn("control", [sys.executable, "-m", "workers.control"], env=self.worker_env)

    def start_node(self, host: Host | str, *extra_args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        """A node agent on ``host`` (again, after a kill: a new boot id), node id = host name,
        work dir ``<host dir>/node``, /metrics on ``0.0.0.0:9100``; ``--advertise-host <addr>``
        where ``workers.gpu`` has that flag; ``extra_args`` appended (``--role rollout``, ...)."""
        h = self.host(host)
        cmd = [sys.executable, "-m", "workers.gpu", "--device", "cpu", "--node-id", h.name,
               "--work-dir", str(h.dir / "node"), "--metrics-port", str(METRICS_PORT), "--metrics-host", "0.0.0.0"]
        if "--advertise-host" in gpu_help():
            cmd += ["--advertise-host", h.addr]
        return h.spawn("gpu", [*cmd, *extra_args], env={**self.worker_env, **(env or {})})

    def node_pids(self, host: Host | str) -> dict:
        """{"agent", "trainer", "router", "engines": [...]} as the host's node agent last wrote them."""
        return read_children(self.host(host).dir / "node")

    def node_children(self, host: Host | str) -> list[int]:
        """The live trainer, router and engine pids of the host's node agent (``children_file``:
        not a pid another process has taken since)."""
        return [pid for pid, _ in left_behind(self.host(host).dir / "node")]

    def log(self, host: Host | str, name: str) -> str:
        path = self.logs / f"{self.host(host).name}-{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tail(self, proc: subprocess.Popen, chars: int = 2000) -> str:
        for host in self.hosts.values():
            for name, p in host.procs.items():
                if p is proc:
                    return self.log(host, name)[-chars:]
        return ""

    # -- talking to the bed from this process

    def _ns_thread(self) -> NamespaceThread:
        if self._thread is None:
            raise RuntimeError("the bed is not started, or has no services host")
        return self._thread

    def submit(self, coro: Awaitable[T], timeout_s: float = 600.0) -> T:
        """Run ``coro`` on the event loop of the thread inside the services namespace."""
        return self._ns_thread().submit(coro, timeout_s)

    def call(self, fn: Callable[[Client], Awaitable[T]], timeout_s: float = 600.0) -> T:
        """``await fn(client)`` with a Temporal client of the bed's server, from inside the bed."""
        async def main() -> T:
            return await fn(await self._ns_thread().client(self.temporal_address))

        return self.submit(main(), timeout_s)

    def run(self, fn: Callable[..., T], *args: Any, timeout_s: float = 600.0) -> T:
        """The blocking ``fn(*args)`` on a thread inside the services namespace (S3, sockets)."""
        return self._ns_thread().run(fn, *args, timeout_s=timeout_s)


@pytest.fixture(scope="module", name="multi_host_bed")
def multi_host_bed_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Bed]]:
    """Factory of started beds: ``multi_host_bed(n_node_hosts=3, services=True, agents=True,
    env=None)``; every bed it made is stopped when the module ends, also after a failure.
    Fails (CI) or skips (elsewhere) with the reason where namespaces cannot be made.
    Import as ``from tests.hosts import multi_host_bed_fixture  # noqa: F401``."""
    require_namespaces()
    beds: list[Bed] = []

    def make(n_node_hosts: int = 3, *, services: bool = True, agents: bool = True,
             env: dict[str, str] | None = None) -> Bed:
        bed = Bed(tmp_path_factory.mktemp("bed"), n_node_hosts, services=services, env=env)
        beds.append(bed)
        return bed.start(agents=agents)

    try:
        yield make
    finally:
        errors = []
        for bed in beds:
            try:
                bed.stop()
            except Exception as err:  # noqa: BLE001 - every bed must go
                errors.append(str(err))
        if errors:
            raise RuntimeError("; ".join(errors))
