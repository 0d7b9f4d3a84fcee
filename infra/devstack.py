"""The embedded stack on one machine: ``python -m infra.devstack up|down|status``.

``up`` starts the Temporal dev server (SQLite file and logs under ``.milestone/``,
UI on :8233, search attributes registered), ``python -m workers.control`` and one
``python -m workers.gpu --device cpu``. Every pid goes into ``.milestone/pids/``;
``down`` stops exactly those (process groups, by pid).

With the ``cells`` extra (Ray) installed, ``up`` also starts a local Ray head
(``ray start --head --block`` on 127.0.0.1:6379, ``$MILESTONE_RAY_PORT`` to change it;
temp dir ``.milestone/ray``) and gives the node agent its address as
``$MILESTONE_RAY_ADDRESS``: fsdp2 cells are placed on it. ``down`` stops it by pid
(``infra.ray_head.stop_head``), never with ``ray stop``. ``up --no-ray`` starts none.

``up --temporal-address HOST:PORT`` starts no dev server: the workers connect to that
frontend with the TLS / mTLS / API-key settings of the environment
(``workers.temporal_connection``). With ``MILESTONE_PAYLOAD_KEY`` set, ``up`` also starts
the codec server on 127.0.0.1:8234 and points the dev server's UI at it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from gpu_runtime.node.children_file import remove_children, stop_left_behind
from gpu_runtime.proc.processes import process_identity, spawn, stop_pid
from infra.temporal_server import server_command, wait_for_port, wait_until_serving
from workers.payload_codec import codec_from_env
from workers.temporal_connection import TemporalSettings, connect_with, settings_from_env

log = logging.getLogger("devstack")
STATE = Path(os.environ.get("MILESTONE_HOME", ".milestone"))
TEMPORAL_PORT = 7233
UI_PORT = 8233
SERVICES = ("ray", "codec", "temporal", "control", "gpu")
CODEC_PORT = 8234
METRICS_PORTS = {"control": 9465, "gpu": 9464}  # Prometheus /metrics (see infra/prometheus.yml)


def _pidfile(name: str) -> Path:
    return STATE / "pids" / f"{name}.pid"


def running(name: str) -> int | None:
    """The service's pid while the process ``up`` started still has it: the pidfile holds the pid
    and its identity (``processes.process_identity``), so a number the kernel has given to another
    process since (after a reboot, or once its counter wrapped) is not taken for the service."""
    found = _recorded(name)
    return found[0] if found else None


def _recorded(name: str) -> tuple[int, str] | None:
    path = _pidfile(name)
    if not path.exists():
        return None
    fields = path.read_text().split()
    pid, identity = int(fields[0]), fields[1] if len(fields) > 1 else None
    now = process_identity(pid)
    if identity is None and now is not None:
        log.warning("%s holds pid %d without its identity (written by an older devstack): not taken for %s;"
                    " stop it by hand if it is, then remove the file", path, pid, name)
    return (pid, identity) if identity is not None and now == identity else None


def _start(name: str, cmd: list[str], env: dict[str, str] | None = None) -> int:
    pid = running(name)
    if pid:
        log.info("%s already running (pid %d)", name, pid)
        return pid
    proc = spawn(cmd, STATE / "logs" / f"{name}.log", env={**s3_env(), **(env or {})})
    _pidfile(name).parent.mkdir(parents=True, exist_ok=True)
    _pidfile(name).write_text(f"{proc.pid} {process_identity(proc.pid)}")
    log.info("%s started (pid %d), log %s", name, proc.pid, STATE / "logs" / f"{name}.log")
    return proc.pid


S3_PORT = 8333
S3_KEYS = ("milestone", "milestone-secret")


def s3_env() -> dict[str, str]:
    """How the workers reach the embedded SeaweedFS (used by s3:// stores)."""
    return {
        "MILESTONE_S3_ENDPOINT": os.environ.get("MILESTONE_S3_ENDPOINT", f"http://127.0.0.1:{S3_PORT}"),
        "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", S3_KEYS[0]),
        "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", S3_KEYS[1]),
    }


def up(node_id: str = "node0", *, s3: bool = False, temporal_address: str | None = None, ray: bool = True) -> None:
    settings = settings_from_env(temporal_address)  # a bad TLS file or key fails here, naming the variable
    codec = codec_from_env()
    if temporal_address is None and settings.uses_tls:
        raise SystemExit(
            "error: TLS / API-key settings are set (MILESTONE_TEMPORAL_*), but the embedded dev server speaks "
            "plaintext: unset them, or use an external frontend with --temporal-address HOST:PORT"
        )
    STATE.mkdir(parents=True, exist_ok=True)
    if s3:
        from infra.seaweedfs import main as seaweed_main

        seaweed_main(["start", "--dir", str(STATE / "s3"), "--port", str(S3_PORT),
                      "--access-key", S3_KEYS[0], "--secret-key", S3_KEYS[1]])
        os.environ.update(s3_env())
    env_py = sys.executable
    codec_url = f"http://127.0.0.1:{CODEC_PORT}" if codec is not None else None
    if codec is not None:
        _start("codec", [env_py, "-m", "infra.codec_server", "--port", str(CODEC_PORT)])
        wait_for_port("127.0.0.1", CODEC_PORT, 60)
    if temporal_address is None:
        _start("temporal", server_command(STATE / "temporal.db", TEMPORAL_PORT, UI_PORT, codec_endpoint=codec_url))
        wait_for_port("127.0.0.1", TEMPORAL_PORT, 60)
        wait_until_serving(f"127.0.0.1:{TEMPORAL_PORT}")
        wait_for_port("127.0.0.1", UI_PORT, 60)
    else:
        _check_reachable(settings)
    worker_env = {"MILESTONE_TEMPORAL_ADDRESS": settings.address, "MILESTONE_TEMPORAL_NAMESPACE": settings.namespace}
    ray_address = start_ray_head() if ray else None
    gpu_env = {**worker_env, **({"MILESTONE_RAY_ADDRESS": ray_address} if ray_address else {})}
    _start("control", [env_py, "-m", "workers.control", "--metrics-port", str(METRICS_PORTS["control"])], worker_env)
    _start(
        "gpu",
        [env_py, "-m", "workers.gpu", "--device", "cpu", "--node-id", node_id,
         "--metrics-port", str(METRICS_PORTS["gpu"]), "--work-dir", str(STATE / "nodes" / node_id)],
        gpu_env,
    )
    if temporal_address is None:
        print(f"Temporal UI: http://localhost:{UI_PORT}   (stop everything with: make down)")
    else:
        print(f"workers connected to {settings.address} (namespace {settings.namespace}; stop with: make down)")
    if codec_url:
        print(f"codec server: {codec_url} (the UI decrypts payloads through it)")


def start_ray_head() -> str | None:
    """The local Ray head fsdp2 cells are placed on (None: the ``cells`` extra is not installed;
    a fsdp2 trainer then starts a Ray instance of its own)."""
    from infra.ray_head import RAY_HEAD_PORT, head_command, head_env, ray_executable, wait_ready

    if ray_executable() is None:
        log.info("ray is not installed (the cells extra): no Ray head started")
        return None
    temp_dir = (STATE / "ray").resolve()
    temp_dir.mkdir(parents=True, exist_ok=True)
    pid = _start("ray", head_command(RAY_HEAD_PORT, temp_dir, os.cpu_count() or 1), head_env())
    wait_ready(pid, RAY_HEAD_PORT)
    print(f"Ray head: 127.0.0.1:{RAY_HEAD_PORT} (pid {pid})")
    return f"127.0.0.1:{RAY_HEAD_PORT}"


def _check_reachable(settings: TemporalSettings) -> None:
    import asyncio

    try:
        asyncio.run(connect_with(settings))
    except RuntimeError as err:
        raise SystemExit(f"error: cannot reach Temporal at {settings.address}: {err}") from None


def down() -> None:
    for name in reversed(SERVICES):
        found = _recorded(name)
        if found:
            pid, identity = found
            if name == "ray":  # the head and every process of it, by pid (never ``ray stop``)
                from infra.ray_head import stop_head

                stop_head(pid)
            else:
                stop_pid(pid, timeout_s=20, identity=identity)
            log.info("%s stopped (pid %d)", name, pid)
        _pidfile(name).unlink(missing_ok=True)
    for node_dir in (STATE / "nodes").glob("*"):  # children left by a SIGKILLed agent
        stop_left_behind(node_dir)
        remove_children(node_dir)
    if (STATE / "s3").exists():
        from infra.seaweedfs import stop_by_pidfile

        if stop_by_pidfile((STATE / "s3").resolve()):
            log.info("SeaweedFS stopped")


def status() -> dict[str, int | None]:
    return {name: running(name) for name in SERVICES}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--s3", action="store_true", help="also start SeaweedFS (S3 on :8333) for s3:// stores")
    p.add_argument("--no-ray", action="store_true", help="start no Ray head (fsdp2 trainers then start their own)")
    p.add_argument("--temporal-address", default=None, metavar="HOST:PORT",
                   help="use this Temporal frontend (TLS / API key from MILESTONE_TEMPORAL_*) instead of a dev server")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.action == "up":
        try:
            up(s3=args.s3, temporal_address=args.temporal_address, ray=not args.no_ray)
        except ValueError as err:  # TemporalSettingsError, PayloadKeyError: names the variable
            raise SystemExit(f"error: {err}") from None
    elif args.action == "down":
        down()
    else:
        for name, pid in status().items():
            print(f"{name:8s} {'pid ' + str(pid) if pid else 'stopped'}")


if __name__ == "__main__":
    main()
