"""The trainer node's side of the pull path: version folders served over HTTP to rollout nodes.

Between checkpoints no weight byte goes through the durable store, so a rollout node on
another machine fetches a new policy version from the trainer's node directly
(``http_pull.pull_version``). ``WeightServer`` answers:

- ``GET /v1/weights/<run>/<version>/manifest?checksum=<c>``: the version's manifest
  (``http_manifest``: files, sizes, per-tensor sha256), computed once per version and cached;
- ``GET /v1/weights/<run>/<version>/files/<relpath>?checksum=<c>``: one file of the
  manifest, sent with ``sendfile`` (from the page cache to the socket, no copy through Python).

``resolve(run_id, version, checksum)`` gives the version's local folder (the caller's:
it may export the version on demand); it runs once per version at a time, so R rollout
nodes asking together trigger one export. A ``LookupError`` / ``FileNotFoundError`` from it
answers 404, a ``ValueError`` 409 (a version it holds under another checksum), and a folder
whose ``milestone.json`` does not name the version and checksum asked for 409 too; errors
are JSON ``{"error": "..."}``. With ``token`` every request needs ``Authorization: Bearer
<token>`` (401 otherwise); a non-loopback host without one is refused
(``gpu_runtime.proc.auth.check_exposure``, the engines' rule).

The folder ``resolve`` gives must keep its files while they are served and never have them
written over in place (the trainer's ``Spares`` write a new export over a pruned version's
file when nothing else links it): hard-link the export into a folder of the server's
(``model_folder.link_folder``). A file that changes anyway fails the puller's per-tensor
check, naming the tensor, and a file that went away has the version resolved again.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from gpu_runtime.models.model_folder import read_meta
from gpu_runtime.proc.auth import authorized, check_exposure, refuse_unauthorized
from gpu_runtime.proc.rpc import send_json
from gpu_runtime.weight_sync.http_manifest import build_manifest

log = logging.getLogger(__name__)

API_PREFIX = "/v1/weights/"
Resolve = Callable[[str, int, str], Path]
_Key = tuple[str, int, str]


class VersionConflict(ValueError):
    """The folder a resolver gave holds another version or checksum than the one asked for."""


@dataclass(frozen=True)
class _Served:
    folder: Path
    manifest: dict[str, Any]
    sizes: dict[str, int]  # relpath -> bytes: only the manifest's files are served


class _Versions:
    """The resolved versions, newest ``keep`` cached; one resolve per version at a time."""

    def __init__(self, resolve: Resolve, keep: int = 4) -> None:
        self._resolve, self._keep = resolve, keep
        self._lock = threading.Lock()
        self._key_locks: dict[_Key, threading.Lock] = {}
        self._cache: OrderedDict[_Key, _Served] = OrderedDict()
        self.waiting = 0  # requests inside ``get`` now (resolving, or queued behind the one resolving)

    def get(self, key: _Key, *, fresh: bool = False) -> _Served:
        """The version's folder and manifest; ``fresh``: resolve again (its folder went away)."""
        with self._lock:
            self.waiting += 1
            if fresh:
                self._cache.pop(key, None)
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        try:
            with key_lock:
                with self._lock:
                    served = self._cache.get(key)
                    if served is not None:
                        self._cache.move_to_end(key)
                        return served
                served = self._resolved(key)
                with self._lock:
                    self._cache[key] = served
                    while len(self._cache) > self._keep:
                        old, _ = self._cache.popitem(last=False)
                        self._key_locks.pop(old, None)
                return served
        finally:
            with self._lock:
                self.waiting -= 1

    def _resolved(self, key: _Key) -> _Served:
        run_id, version, checksum = key
        t0 = time.perf_counter()
        folder = Path(self._resolve(run_id, version, checksum))
        meta = read_meta(folder)
        if meta.get("weight_version") != version or meta.get("checksum") != checksum:
            raise VersionConflict(
                f"run {run_id}: the folder for v{version} holds weight_version {meta.get('weight_version')} with "
                f"checksum {meta.get('checksum')}, asked for v{version} with checksum {checksum}")
        manifest = build_manifest(folder, run_id, version, checksum)
        sizes = {f["path"]: int(f["size"]) for f in manifest["files"]}
        log.info("weights v%d of run %s: serving %s (%d files, %.2f GB; resolved and hashed in %.2fs)", version,
                 run_id, folder, len(sizes), sum(sizes.values()) / 1e9, time.perf_counter() - t0)
        return _Served(folder, manifest, sizes)


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # every rollout node of a run may connect at once (the default backlog is 5)
    block_on_close = False  # stop() closes the connections; a resolve still running ends on its own

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], weights: WeightServer) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        self.weights = weights
        super().__init__(address, handler)


class WeightServer:
    """Serves version folders to pullers (``http_pull.pull_version``); ``start()``, ``url``, ``stop()``."""

    def __init__(self, host: str, port: int = 0, *, resolve: Resolve, token: str | None = None) -> None:
        check_exposure(host, token, what="weight server")
        self.host, self.token = host, token
        self.versions = _Versions(resolve)
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._httpd = _HTTPServer((host, port), _Handler, self)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def waiting_for_versions(self) -> int:
        """Requests waiting for a version now: the one resolving it and those queued behind it."""
        return self.versions.waiting

    @property
    def active_connections(self) -> int:
        with self._conns_lock:
            return len(self._conns)

    def start(self) -> WeightServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="weight-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and cut every open connection (a transfer in flight ends with an error)."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()
        with self._conns_lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _opened(self, conn: socket.socket) -> None:
        with self._conns_lock:
            self._conns.add(conn)

    def _closed(self, conn: socket.socket) -> None:
        with self._conns_lock:
            self._conns.discard(conn)


class _BadRequest(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a pull's manifest and files over one connection
    timeout = 120  # a client that stops reading frees its thread
    server: _HTTPServer

    def setup(self) -> None:
        super().setup()
        # headers then a small file's body: without this, Nagle holds the body until the
        # client's delayed ACK (40 ms a file)
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.weights._opened(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.weights._closed(self.connection)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug(format, *args)

    def do_GET(self) -> None:
        weights = self.server.weights
        if weights.token and not authorized(self.headers.get("Authorization"), weights.token):
            refuse_unauthorized(self, "this weight server needs Authorization: Bearer <token>")
            return
        try:
            key, rel = self._parsed()
            served = self._served(weights, key)
            if rel is None:
                send_json(self, 200, served.manifest)
            else:
                self._send_file(weights, key, served, rel)
        except _BadRequest as err:
            send_json(self, err.code, {"error": str(err)})
        except (ConnectionError, TimeoutError) as err:
            log.info("weight server: %s went away mid-answer (%s)", self.client_address[0], err)
            self.close_connection = True

    def _parsed(self) -> tuple[_Key, str | None]:
        """((run, version, checksum), None for the manifest or the file's relpath)."""
        url = urlsplit(self.path)
        if not url.path.startswith(API_PREFIX):
            raise _BadRequest(404, f"no such endpoint {url.path!r} (GET {API_PREFIX}<run>/<version>/manifest or "
                                   f".../files/<path>)")
        parts = url.path[len(API_PREFIX):].split("/")
        manifest = len(parts) == 3 and parts[2] == "manifest"
        if not manifest and not (len(parts) >= 4 and parts[2] == "files"):
            raise _BadRequest(404, f"no such endpoint {url.path!r}")
        run_id = unquote(parts[0])
        if run_id in ("", ".", "..") or any(c in run_id for c in "/\\\x00"):
            raise _BadRequest(400, f"run id {run_id!r} is not a run id")
        try:
            version = int(parts[1])
        except ValueError:
            raise _BadRequest(400, f"version {parts[1]!r} is not an integer") from None
        checksum = parse_qs(url.query).get("checksum", [""])[0]
        if not checksum:
            raise _BadRequest(400, "query parameter checksum is required (the version's milestone.json checksum)")
        rel = None if manifest else unquote("/".join(parts[3:]))
        return (run_id, version, checksum), rel

    def _served(self, weights: WeightServer, key: _Key, fresh: bool = False) -> _Served:
        run_id, version, checksum = key
        try:
            return weights.versions.get(key, fresh=fresh)
        except (LookupError, FileNotFoundError) as err:
            raise _BadRequest(404, f"run {run_id} v{version} (checksum {checksum}): not available here: {err}") from None
        except ValueError as err:  # VersionConflict, or the resolver's own refusal
            raise _BadRequest(409, f"run {run_id} v{version} (checksum {checksum}): {err}") from None
        except Exception as err:  # the resolver failed (an export that crashed): the puller sees why
            log.exception("weight server: resolving run %s v%d failed", run_id, version)
            raise _BadRequest(500, f"run {run_id} v{version}: resolving the version failed: "
                                   f"{type(err).__name__}: {err}") from None

    def _send_file(self, weights: WeightServer, key: _Key, served: _Served, rel: str) -> None:
        if rel not in served.sizes:
            raise _BadRequest(404, f"{rel!r} is not a file of v{key[1]} (see its manifest)")
        try:
            f = open(served.folder / rel, "rb")
        except FileNotFoundError:  # the folder was pruned since: resolve it again, once
            served = self._served(weights, key, fresh=True)
            try:
                if rel not in served.sizes:
                    raise FileNotFoundError(rel)
                f = open(served.folder / rel, "rb")
            except FileNotFoundError:
                raise _BadRequest(404, f"{rel!r} of v{key[1]}: gone from {served.folder}") from None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != served.sizes[rel]:
                raise _BadRequest(409, f"{rel!r} of v{key[1]}: {size} bytes on disk, the manifest has "
                                       f"{served.sizes[rel]} (rewritten since)")
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            self.connection.sendfile(f, 0, size)
