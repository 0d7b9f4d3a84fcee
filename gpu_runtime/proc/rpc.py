"""A minimal typed JSON-over-HTTP RPC between a process and its children (the node agent
and its trainer, the trainer and its DP cells).

``POST /call/<method>`` with the argument model's JSON -> ``{"result": <result model>}``
or HTTP 500 with ``{"error_type", "message"}`` (404 ``UnknownMethod`` for a name the
server does not serve). Both ends go through the methods' declarations (``spec.rpc``):
the server validates the argument into the method's model, the client parses the result
into its result model. One call at a time (the trainer is single-threaded).
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from gpu_runtime.proc.http_client import http_client
from gpu_runtime.proc.processes import spawn, stop_pid
from spec.rpc import Handler, RpcMethod

log = logging.getLogger(__name__)
A = TypeVar("A", bound=BaseModel)
R = TypeVar("R", bound=BaseModel)


class RemoteError(RuntimeError):
    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message


def send_json(handler: BaseHTTPRequestHandler, code: int, obj: Any) -> None:
    """Answer an HTTP request with ``obj`` as JSON."""
    body = json.dumps(obj).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def serve_until_interrupted(server: ThreadingHTTPServer, url: str) -> None:
    """Print ``READY <url>`` (the one stdout line its launcher waits for), then serve until
    interrupted; the server is closed either way."""
    print(f"READY {url}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


class RPCServer:
    """Serves the handlers of one ``MethodTable`` (``table.serve(...)``: one per method)."""

    def __init__(self, host: str, port: int, methods: dict[str, Handler]) -> None:
        self.methods = methods
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:  # quiet
                log.debug(fmt, *args)

            def _send(self, code: int, obj: Any) -> None:
                send_json(self, code, obj)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(200, {"ok": True})
                else:
                    self._send(404, {"error_type": "NotFound", "message": self.path})

            def do_POST(self) -> None:
                name = self.path.removeprefix("/call/")
                fn = server.methods.get(name)
                if fn is None:
                    self._send(404, {"error_type": "UnknownMethod",
                                     "message": f"{name!r} (this server serves {sorted(server.methods)})"})
                    return
                n = int(self.headers.get("Content-Length", "0"))
                try:
                    body = self.rfile.read(n)
                    with server.lock:
                        result = fn.serve(body)
                    self._send(200, {"result": result})
                except Exception as err:  # reported to the caller, which maps it
                    log.exception("rpc %s failed", name)
                    self._send(500, {"error_type": type(err).__name__, "message": str(err)})

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def announce_ready(self) -> None:
        """The line ``start_rpc_process`` waits for on stdout."""
        print(f"READY port={self.port} pid={os.getpid()}", flush=True)

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)


class ServerDidNotStart(RuntimeError):
    pass


def start_rpc_process(cmd: list[str], log_path: Path, timeout_s: float, *,
                      env: dict | None = None) -> tuple[subprocess.Popen, RPCClient]:
    """Spawn an RPC server process (it prints ``READY port=<p>`` once it serves, everything
    else goes to ``log_path``) and a client for it. One that does not announce itself within
    ``timeout_s`` is stopped by pid: ``ServerDidNotStart`` with what it printed."""
    proc = spawn(cmd, log_path, stdout_pipe=True, env=env)
    line = read_line(proc, timeout_s)
    m = re.match(r"READY port=(\d+)", line or "")
    if not m:
        stop_pid(proc.pid, proc)
        raise ServerDidNotStart(f"see {log_path}: {line!r}")
    return proc, RPCClient(f"http://127.0.0.1:{m.group(1)}")


def read_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """The process's next stdout line, or None after ``timeout_s``."""
    out: list[str] = []
    stdout = proc.stdout
    if stdout is None:
        raise ValueError("read_line needs a process started with stdout=PIPE")
    t = threading.Thread(target=lambda: out.append(stdout.readline().decode()), daemon=True)
    t.start()
    t.join(timeout_s)
    return out[0].strip() if out else None


class RPCClient:
    """Calls to one RPC server, through one HTTP client (building a client per call cost
    ~70 ms of CPU: ``gpu_runtime.proc.http_client``)."""

    def __init__(self, base_url: str, timeout_s: float = 3600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = http_client()

    def close(self) -> None:
        self._http.close()

    def call(self, method: RpcMethod[A, R], arg: A, timeout_s: float | None = None) -> R:
        """``method`` on the server: its answer as the method's result model."""
        if not isinstance(arg, method.arg):
            raise TypeError(f"{method.name} takes a {method.arg.__name__}, not a {type(arg).__name__}")
        try:
            resp = self._http.post(
                f"{self.base_url}/call/{method.name}", content=arg.model_dump_json(),
                headers={"Content-Type": "application/json"}, timeout=timeout_s or self.timeout_s,
            )
        except httpx.HTTPError as err:
            raise ConnectionError(f"{self.base_url}: {method.name}: {err}") from err
        data = resp.json()
        if resp.status_code != 200:
            raise RemoteError(data.get("error_type", "Error"), data.get("message", resp.text))
        return method.result.model_validate(data["result"])

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            return self._http.get(f"{self.base_url}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False
