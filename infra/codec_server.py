"""Codec server: lets the Temporal UI and CLI show payloads encrypted by ``workers.payload_codec``.

    MILESTONE_PAYLOAD_KEY=... python -m infra.codec_server --port 8234

Implements Temporal's remote codec protocol: ``POST .../encode`` and ``POST .../decode``
take and return a ``Payloads`` message as protobuf JSON (only the last path segment
counts, so ``http://host:8234/{namespace}/decode`` works too); a bad body or a payload
sealed with another key answers 400. Browsers call it from the UI's origin, so it
answers CORS preflights for the ``--cors-origin`` list (default the dev server's UI).

Whoever reaches it can decrypt every payload: it binds 127.0.0.1, and on any other
``--host`` it requires ``Authorization: Bearer $MILESTONE_CODEC_TOKEN`` (the CLI sends
one with ``temporal ... --codec-auth "Bearer <token>"``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from temporalio.api.common.v1 import Payloads

from gpu_runtime.engine.auth import authorized, is_loopback
from gpu_runtime.proc.rpc import serve_until_interrupted
from workers.payload_codec import EncryptionCodec, PayloadKeyError, codec_from_env

log = logging.getLogger("infra.codec_server")
TOKEN_ENV = "MILESTONE_CODEC_TOKEN"
DEFAULT_ORIGINS = ("http://localhost:8233", "http://127.0.0.1:8233")
ALLOW_HEADERS = "Content-Type, X-Namespace, Authorization"


def transform(codec: EncryptionCodec, action: str, body: bytes) -> bytes:
    """``encode`` / ``decode`` a protobuf-JSON ``Payloads`` body; ValueError on a bad one."""
    try:
        payloads = json_format.Parse(body, Payloads())
    except (json_format.ParseError, UnicodeDecodeError) as err:
        raise ValueError(f"body is not a Payloads message in protobuf JSON: {err}") from None
    one = codec.encrypt if action == "encode" else codec.decrypt
    out = [one(p) for p in payloads.payloads]
    return json_format.MessageToJson(Payloads(payloads=out)).encode()


def make_handler(codec: EncryptionCodec, origins: tuple[str, ...], token: str | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("%s " + fmt, self.address_string(), *args)

        def _cors(self) -> None:
            origin = self.headers.get("Origin")
            if origin and origin in origins:
                self.send_header("Access-Control-Allow-Origin", origin)
                self.send_header("Access-Control-Allow-Credentials", "true")
                self.send_header("Vary", "Origin")

        def _answer(self, code: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(code)
            self._cors()
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_OPTIONS(self) -> None:  # noqa: N802 - CORS preflight
            self.send_response(200)
            self._cors()
            self.send_header("Access-Control-Allow-Methods", "POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", ALLOW_HEADERS)
            self.send_header("Access-Control-Max-Age", "600")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            action = self.path.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]
            if token is not None and not authorized(self.headers.get("Authorization"), token):
                self._answer(401, b'{"error": "unauthorized"}')
                return
            if action not in ("encode", "decode"):
                self._answer(404, json.dumps({"error": f"no route {self.path}: use .../encode or .../decode"}).encode())
                return
            try:
                self._answer(200, transform(codec, action, body))
            except ValueError as err:  # a bad body, or a payload sealed with another key
                log.warning("%s %s: %s", action, self.headers.get("X-Namespace", "-"), err)
                self._answer(400, json.dumps({"error": str(err)}).encode())

    return Handler


def build_server(host: str, port: int, codec: EncryptionCodec, origins: tuple[str, ...], token: str | None) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(codec, origins, token))
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8234)
    ap.add_argument("--cors-origin", action="append", default=None, metavar="URL",
                    help=f"origin of a Temporal UI allowed to call (repeatable; default {', '.join(DEFAULT_ORIGINS)})")
    args = ap.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=os.environ.get("MILESTONE_LOG_LEVEL", "INFO"),
                        format="%(asctime)s codec %(levelname)s %(message)s")
    try:
        codec = codec_from_env()
    except PayloadKeyError as err:
        ap.error(str(err))
    if codec is None:
        ap.error("set MILESTONE_PAYLOAD_KEY or MILESTONE_PAYLOAD_KEY_FILE (the key the workers encrypt with)")
    token = os.environ.get(TOKEN_ENV) or None
    if not is_loopback(args.host) and token is None:
        ap.error(f"--host {args.host} exposes decryption to the network: set {TOKEN_ENV} (a bearer token) or bind 127.0.0.1")
    server = build_server(args.host, args.port, codec, tuple(args.cors_origin or DEFAULT_ORIGINS), token)
    url = f"http://{args.host}:{server.server_address[1]}"
    log.info("codec server for key %s on %s", codec.key_id, url)
    serve_until_interrupted(server, url)


if __name__ == "__main__":
    main()
