"""A minimal JSON-over-HTTP RPC used between a node agent and its trainer process.

``POST /call/<method>`` with a JSON object -> ``{"result": ...}`` or HTTP 500 with
``{"error_type", "message"}``. One call at a time (the trainer is single-threaded).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

log = logging.getLogger(__name__)


class RemoteError(RuntimeError):
    def __init__(self, error_type: str, message: str) -> None:
        super().__init__(f"{error_type}: {message}")
        self.error_type = error_type
        self.message = message


class RPCServer:
    def __init__(self, host: str, port: int, methods: dict[str, Callable[[dict], Any]]) -> None:
        self.methods = methods
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:  # quiet
                log.debug(fmt, *args)

            def _send(self, code: int, obj: Any) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._send(200, {"ok": True})
                else:
                    self._send(404, {"error_type": "NotFound", "message": self.path})

            def do_POST(self) -> None:
                name = self.path.removeprefix("/call/")
                fn = server.methods.get(name)
                if fn is None:
                    self._send(404, {"error_type": "NotFound", "message": name})
                    return
                n = int(self.headers.get("Content-Length", "0"))
                try:
                    arg = json.loads(self.rfile.read(n) or b"{}")
                    with server.lock:
                        result = fn(arg)
                    self._send(200, {"result": result})
                except Exception as err:  # reported to the caller, which maps it
                    log.exception("rpc %s failed", name)
                    self._send(500, {"error_type": type(err).__name__, "message": str(err)})

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)


class RPCClient:
    def __init__(self, base_url: str, timeout_s: float = 3600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def call(self, method: str, arg: dict | None = None, timeout_s: float | None = None) -> Any:
        try:
            resp = httpx.post(
                f"{self.base_url}/call/{method}", json=arg or {}, timeout=timeout_s or self.timeout_s
            )
        except httpx.HTTPError as err:
            raise ConnectionError(f"{self.base_url}: {method}: {err}") from err
        data = resp.json()
        if resp.status_code != 200:
            raise RemoteError(data.get("error_type", "Error"), data.get("message", resp.text))
        return data["result"]

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health", timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False
