"""Who may talk to an engine, a router or the weight server: loopback only, or a bearer token.

Engines and the router bind 127.0.0.1 by default (``engines.host``); so does the weight
server that rollout nodes pull versions from (``weight_sync.http_server``). Bound anywhere
else they are reachable from the network, so they must require
``Authorization: Bearer <token>``. The token comes from ``MILESTONE_ENGINE_TOKEN`` in
the node agent's environment and reaches engine subprocesses through their
environment, never their command line (``ps`` shows argv to every local user) and
never a workflow input (Temporal history keeps inputs forever).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
from http.server import BaseHTTPRequestHandler

ENGINE_TOKEN_ENV = "MILESTONE_ENGINE_TOKEN"


def engine_token() -> str | None:
    """``$MILESTONE_ENGINE_TOKEN``, or None when unset or empty."""
    return os.environ.get(ENGINE_TOKEN_ENV) or None


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps a server on this machine (127.0.0.0/8, ::1, localhost)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def check_exposure(host: str, token: str | None, what: str = "engine") -> None:
    """Refuse to serve ``what`` on a non-loopback ``host`` without a token."""
    if not is_loopback(host) and not token:
        raise ValueError(
            f"{what} host {host!r} is reachable from the network: set {ENGINE_TOKEN_ENV} (a bearer token every "
            f"request must carry) or bind 127.0.0.1 (engines.host)"
        )


def authorized(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>`` (constant-time compare)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def bearer_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def refuse_unauthorized(handler: BaseHTTPRequestHandler, message: str) -> None:
    """Answer a request without the bearer token: 401, ``WWW-Authenticate: Bearer``, ``{"error": message}``."""
    body = json.dumps({"error": message}).encode()
    handler.send_response(401)
    handler.send_header("WWW-Authenticate", "Bearer")
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
