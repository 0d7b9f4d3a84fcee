"""A real reward-model / judge HTTP server for tests, on 127.0.0.1, in a thread of the test.

It answers a JSON list of samples (``reward.kind: http``) with a list of scores and one
sample (``judge``) with ``{"score": ..}``, counts what it was asked, and can misbehave on
purpose: 503 for the first N requests, one 500 after K successful judgements, a fixed
status or body. Started and stopped by the ``reward_server`` context manager, also when
the test fails.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def length_score(sample: dict) -> float:
    """The default score: a pure function of the sample (so a fault-free run can be recomputed)."""
    return len(sample["response"]) / 10 + (0.5 if sample["label"] and sample["label"] in sample["response"] else 0.0)


@dataclass
class Behaviour:
    score: Callable[[dict], float] = length_score
    fail_first: int = 0  # answer 503 to the first N requests
    fail_once_after: int | None = None  # answer 500 once, after this many successful judgements
    status: int | None = None  # always answer this status (with ``body``)
    body: bytes | None = None  # always answer this body (status 200 unless ``status``)


@dataclass
class ServerLog:
    requests: int = 0
    batches: list[int] = field(default_factory=list)  # samples per successful http request
    judged: Counter = field(default_factory=Counter)  # sample_id -> successful judgements
    keys: Counter = field(default_factory=Counter)  # Idempotency-Key -> requests
    failed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class RewardServer:
    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.log = ServerLog()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True, name="reward-server")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/score"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, body = server._answer(payload, self.headers.get("Idempotency-Key"))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler

    def _answer(self, payload: object, key: str | None) -> tuple[int, bytes]:
        b, log = self.behaviour, self.log
        with log.lock:
            log.requests += 1
            if key:
                log.keys[key] += 1
            if b.status is not None or b.body is not None:
                return b.status or 200, b.body or b"{}"
            if log.requests <= b.fail_first:
                log.failed += 1
                return 503, b'{"error": "warming up"}'
            if b.fail_once_after is not None and sum(log.judged.values()) >= b.fail_once_after:
                b.fail_once_after = None
                log.failed += 1
                return 500, b'{"error": "judge crashed"}'
            if isinstance(payload, list):
                log.batches.append(len(payload))
                return 200, json.dumps([b.score(s) for s in payload]).encode()
            assert isinstance(payload, dict)
            log.judged[payload["sample_id"]] += 1
            return 200, json.dumps({"score": b.score(payload)}).encode()


@contextmanager
def reward_server(behaviour: Behaviour | None = None) -> Iterator[RewardServer]:
    server = RewardServer(behaviour or Behaviour())
    server.thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
        server.thread.join(timeout=10)
