"""The OpenAI-compatible endpoint a chunk's agents call: ``POST /v1/chat/completions`` and
``GET /v1/models``, on the node's loopback, one API key per episode.

It lives as long as the chunk's rollout (``with AgentEndpoint(...)``), on an OS-picked port of
127.0.0.1: only processes on this node reach it, and a key opens only its own episode, so an
agent can neither read nor spend another episode's calls. Every error is OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``), so the agent's client raises it as the
SDK's own exception.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from gpu_runtime.proc.rpc import send_json
from gpu_runtime.rollout.agent import openai_protocol as proto
from gpu_runtime.rollout.agent.openai_session import EpisodeSession

log = logging.getLogger(__name__)
MAX_BODY = 16 << 20


class AgentEndpoint:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self._sessions: dict[str, EpisodeSession] = {}
        self._lock = threading.Lock()
        self.fatal: BaseException | None = None  # a call the engines failed: the chunk's rollout fails with it
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                log.debug("agent endpoint: " + format, *args)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                endpoint._answer(self, "GET")

            def do_POST(self) -> None:  # noqa: N802
                endpoint._answer(self, "POST")

        self._server = ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="agent-endpoint", daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    def __enter__(self) -> AgentEndpoint:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def admit(self, session: EpisodeSession) -> str:
        """``session``'s current key opens it (an earlier attempt's key no longer does)."""
        with self._lock:
            for k in [k for k, s in self._sessions.items() if s is session]:
                del self._sessions[k]
            self._sessions[session.key] = session
        return session.key

    def _session(self, handler: BaseHTTPRequestHandler) -> EpisodeSession:
        auth = handler.headers.get("Authorization", "")
        key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        with self._lock:
            session = self._sessions.get(key)
        if session is None:
            raise proto.RequestError("incorrect API key: each episode has its own (the api_key passed to run())",
                                     status=401, code="invalid_api_key")
        return session

    def _answer(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        path = handler.path.split("?", 1)[0].rstrip("/")
        try:
            length = int(handler.headers.get("Content-Length") or 0)
            if length > MAX_BODY:
                raise proto.RequestError(f"request body over {MAX_BODY} bytes", status=413)
            raw = handler.rfile.read(length) if length else b""
            session = self._session(handler)
            if method == "GET" and path == "/v1/models":
                status, body = 200, {"object": "list", "data": [
                    {"id": proto.MODEL, "object": "model", "created": 0, "owned_by": "milestone"}]}
            elif method == "POST" and path == "/v1/chat/completions":
                try:
                    request = json.loads(raw or b"null")
                except json.JSONDecodeError as e:
                    raise proto.RequestError(f"the body is not JSON: {e}") from e
                status, body = 200, session.complete(request)
            else:
                raise proto.RequestError(f"{method} {path} is not served here (POST /v1/chat/completions, "
                                         f"GET /v1/models)", status=404, code="unknown_url")
        except proto.RequestError as e:
            status, body = e.status, e.body()
        except Exception as e:  # noqa: BLE001 - the engines failed past their retries (or stale weights...)
            log.warning("agent endpoint: a call failed: %s: %s", type(e).__name__, e)
            self.fatal = self.fatal or e  # the rollout fails with it, and its retry replays the recorded calls
            status, body = 503, proto.RequestError(f"{type(e).__name__}: {e}", status=503, kind="server_error").body()
        send_json(handler, status, body)
